"""A toy policy-gradient (REINFORCE) loop: tokenmill generates rollouts, transformers trains,
and the new weights are pushed back into the running engine after every step.

The reward is the fraction of generated tokens that belong to a small "target" set, so the
policy should learn to emit them more often. Run:

    python examples/rl_rollout.py                 # the tiny model
    python examples/rl_rollout.py --model PATH --steps 5
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.default_model import TINY_MODEL_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(TINY_MODEL_DIR))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()

    llm = LLM(model=args.model, num_kv_slots=16384)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    prompt = llm.engine.tokenizer.encode("def ")
    target = set(range(10, 60))
    params = SamplingParams(n=args.rollouts, temperature=1.0, max_tokens=24, logprobs=0, seed=0)

    for step in range(args.steps):
        rollout = llm.generate([prompt], params, use_tqdm=False)[0]
        rewards = torch.tensor([sum(t in target for t in c.token_ids) / len(c.token_ids) for c in rollout.outputs])
        advantages = rewards - rewards.mean()
        loss = torch.zeros(())
        for completion, advantage in zip(rollout.outputs, advantages):
            ids = torch.tensor([prompt + completion.token_ids])
            logits = policy(ids).logits[0, len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None]).sum()
            loss = loss - advantage * logp / len(rollout.outputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        version = llm.update_weights(((n, p.detach()) for n, p in policy.named_parameters()))
        sampled_under = {v for c in rollout.outputs for v in c.weight_versions}
        print(
            f"step {step}: mean reward {rewards.mean():.3f}, rollouts from weights {sorted(sampled_under)}, "
            f"pushed version {version}"
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
