"""Disaggregated prefill on the decode tier: prompts prefilled by the prefill tier, their KV streamed
into the blocks this replica reserved.

- `stage`: `RemotePrefillStage` routes each admitted request (local or remote) and hands finished
  prompts to the engine thread; `RemotePrefill` builds the whole subpackage from the server's config.
- `client`: one `Prefill` call per attempt, retried on another replica.
- `pool`: the replicas, their health (handshake, backoff) and load, and the per-replica counters.
- `transfer`: one request's KV arriving into its reserved blocks, the outcomes, the tier's counters.
- `targets`: parsing `--prefill` and resolving it to replica addresses.
"""
