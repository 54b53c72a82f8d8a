"""Quiet the model libraries' own console output in Turnstile's processes, unless asked for it.

Every model load and checkpoint write goes through transformers, which draws tqdm progress bars
on stderr ("Loading weights" in `from_pretrained`, "Writing model shards" in `save_pretrained`,
and huggingface_hub's bars under them), and peft's `get_peft_model` reads transformers'
deprecated `is_gradient_checkpointing` property (peft 0.21 `PeftModel.__init__`), which warns with a
FutureWarning ("`is_gradient_checkpointing` is deprecated and will be removed in v6") the first
time in each process.  The engine and the trainer load and save on every step, so `make demo`'s
logs filled with bars and the same warning from each process.  None of it is ours to act on.

`quiet_model_libraries()` switches those off at their source, with the libraries' own switches:
transformers' `utils.logging.disable_progress_bar()` (which also turns off huggingface_hub's,
`huggingface_hub.utils.disable_progress_bars()`:
https://huggingface.co/docs/transformers/main_classes/logging) and one `warnings` filter for that
one FutureWarning (matched by its text, so any other warning still shows).  `app.engines.modeling`
calls it on import, so every process that loads a model is quiet.

`TURNSTILE_VERBOSE=1` (or true/yes/on) keeps them all, for debugging a load: `make demo
VERBOSE=1`, `bash scripts/demo.sh -v`, or the variable set for any process.  It is read from the
process environment (not `.env`) so a launcher can set it for the processes it starts.
"""
from __future__ import annotations

import os
import warnings

VERBOSE_ENV = "TURNSTILE_VERBOSE"
# peft reads the deprecated property through getattr; the text is transformers' (modeling_utils.py).
GRADIENT_CHECKPOINTING_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"


def verbose() -> bool:
    """Whether `TURNSTILE_VERBOSE` asks for the libraries' own output ("1", "true", "yes", "on")."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def quiet_model_libraries(keep: bool | None = None) -> bool:
    """Turn off transformers' and huggingface_hub's progress bars and the `is_gradient_checkpointing`
    FutureWarning in this process, unless `keep` (default: `verbose()`).  Returns whether it did.
    Idempotent; the bars stay off for the life of the process (`enable_progress_bar` undoes it)."""
    if verbose() if keep is None else keep:
        return False
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()  # also done by transformers' call; stated for the hub's own downloads
    warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_DEPRECATION, category=FutureWarning)
    return True
