"""The chat page's picture in docs/chat-page.md: ``tokenmill serve`` on the default model, one question asked
through the page in Debian's chromium (Playwright), the page saved as a PNG.

    python tools/web_screenshot.py [--out docs/chat-page.png] [--question "..."]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time

import httpx
from playwright.sync_api import sync_playwright

PORT = 8799


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/chat-page.png")
    parser.add_argument("--question", default="What is the capital of France? Answer in one sentence.")
    args = parser.parse_args()
    server = subprocess.Popen(["tokenmill", "serve", "--port", str(PORT)])
    url = f"http://127.0.0.1:{PORT}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1100, "height": 620})
            page.goto(url)
            page.fill("#prompt", args.question)
            page.click("#send")
            page.locator(".message.assistant .meta", has_text="TTFT").wait_for(timeout=120_000)
            page.screenshot(path=args.out)
            browser.close()
    finally:
        server.terminate()
        server.wait()
    print(args.out)


if __name__ == "__main__":
    main()
