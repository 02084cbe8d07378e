"""HTTP plumbing, knowing no API's request bodies: the app's state (:mod:`.state`), errors in each
API's shape (:mod:`.errors`), the API-key check (:mod:`.auth`), body limits (:mod:`.body_limit`),
header deadlines and size caps (:mod:`.header_limits`), the JSON depth cap (:mod:`.nesting`), server-sent events
(:mod:`.sse`) and log throttling (:mod:`.log_throttle`)."""
