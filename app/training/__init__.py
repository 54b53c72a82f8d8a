"""Training: from recorded completions to GRPO updates and new weights on the engines.

Read in this order:

* `trajectories` — token-exact builders (`per_request`, `prefix_merging`) and ingestion checks
* `store`        — build and store an episode's `Trajectory` rows, idempotently
* `grpo`         — group advantages, the clipped + TIS + KL policy loss, loss aggregation
* `batching`     — padded micro-batches under a token budget
* `policy`       — model loading, LoRA, logprobs of sampled tokens, weight files
* `trainer`      — `Trainer`: resident model + AdamW, one `update` per step, checkpoints
* `checkpoints`  — run directories, atomic checkpoints, the per-run training lock
* `weight_sync`  — `POST /v1/load_weights` to every engine
* `steps`        — `train_step(run_id, step, episode_ids)`: the whole step, resumable

Only `trainer`, `policy`, `batching`, `grpo` and `steps` (lazily) import torch.
"""
