"""GPU check of the engine contract (run by scripts/gpu_check.sh on a machine with a CUDA GPU).

Part 1, embedded engine on CUDA (needs only torch + transformers): the continuous-batching
scheduler generates on the GPU in fp32; the trainer-side recomputation of the sampled
tokens' logprobs must agree; a perturbed checkpoint is reloaded and must be followed.

Part 2, vLLM (needs ``pip install -r requirements-gpu.txt``): serves a small model with
Turnstile's ``vllm serve`` command line (``app.engines.vllm``), runs contract checks against it
(token ids, /tokenize equality, stream = non-stream under a seed, tools accepted, context
overflow → 400), compares vLLM's logprobs with a transformers recomputation (vLLM in fp32),
performs one weight reload through ``VLLMReloader`` and checks the new logprobs follow it.

Model for part 2: ``$TURNSTILE_GPU_MODEL`` (a local directory or a cached Hugging Face id),
else a cached ``Qwen/Qwen2.5-0.5B-Instruct`` / ``Qwen/Qwen3-0.6B``, else Turnstile's tiny model
written to a temporary directory.  Prints one JSON summary line at the end; exit status 0
when every check that ran passed, 1 otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.engines.embedded.batching import BatchScheduler  # noqa: E402
from app.engines.embedded.events import GenerationRequest, TokenEvent  # noqa: E402
from app.engines.modeling import build_tiny_model, load_tokenizer, save_weights  # noqa: E402
from app.engines.embedded.sampling import SamplingParams  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
RESULTS: dict = {}


def recompute(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids], device=device)).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt_ids) - 1:-1]
    return lp.gather(1, torch.tensor(token_ids, device=device)[:, None])[:, 0].cpu()


def perturb(model, seed: int, scale: float = 0.02) -> None:
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, dtype=p.dtype).to(p.device) * scale * (p.float().std() + 1e-3))


def run_scheduler(scheduler, prompts, tokens=24):
    reqs = [scheduler.submit(GenerationRequest(p, tokens, SamplingParams(temperature=1.0, seed=i), frozenset()))
            for i, p in enumerate(prompts)]
    outs = []
    for r in reqs:
        samples = []
        while True:
            e = r.events.get(timeout=300)
            if isinstance(e, TokenEvent):
                samples.append(e.sample)
                if e.finish_reason:
                    break
        outs.append((r.policy_version, samples))
    return outs


def check_embedded_cuda() -> dict:
    tokenizer = load_tokenizer()
    model = build_tiny_model(0).cuda()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": "x " * (3 + 9 * i)}],
                                             add_generation_prompt=True, return_dict=False) for i in range(8)]
    scheduler = BatchScheduler(model, max_batch=8).start()
    try:
        started = time.perf_counter()
        outs = run_scheduler(scheduler, prompts)
        rate = sum(len(s) for _, s in outs) / (time.perf_counter() - started)
        diff = max((recompute(model, p, [x.token_id for x in s]) - torch.tensor([x.logprob for x in s])).abs().max().item()
                   for p, (_, s) in zip(prompts, outs))
        new = build_tiny_model(0)
        perturb(new, 1, 0.5)
        scheduler.reload(new.state_dict(), 1)
        new = new.cuda()
        outs2 = run_scheduler(scheduler, prompts[:2])
        diff_new = max((recompute(new, p, [x.token_id for x in s]) - torch.tensor([x.logprob for x in s])).abs().max().item()
                       for p, (_, s) in zip(prompts, outs2))
        versions = sorted({v for v, _ in outs2})
    finally:
        scheduler.stop()
    ok = diff < 1e-4 and diff_new < 1e-4 and versions == [1]
    return {"ok": ok, "tok_per_s_batch8": round(rate, 1), "logprob_max_abs_diff": diff,
            "after_reload_max_abs_diff": diff_new, "versions_after_reload": versions}


def pick_model(tmp: Path) -> tuple[str, str]:
    """(path or id for vLLM, description)."""
    if os.environ.get("TURNSTILE_GPU_MODEL"):
        return os.environ["TURNSTILE_GPU_MODEL"], "from TURNSTILE_GPU_MODEL"
    try:
        from huggingface_hub import snapshot_download

        for repo in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen3-0.6B"):
            try:
                return snapshot_download(repo, local_files_only=True), f"{repo} (HF cache)"
            except Exception:  # noqa: BLE001 (not in the cache: try the next model)
                continue
    except ImportError:
        pass
    target = tmp / "tiny"
    save_weights(build_tiny_model(0), target)
    load_tokenizer().save_pretrained(target)
    return str(target), "turnstile tiny model (no Qwen in the local cache; nothing can be downloaded here)"


def check_vllm(tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.engines.client import EngineClient, EngineHTTPError
    from app.engines.vllm import VLLMReloader, VLLMServeConfig, serve_command

    model_path, described = pick_model(tmp)
    port = 8299
    argv, env = serve_command(VLLMServeConfig(model=model_path, port=port, dtype="float32",
                                              gpu_memory_utilization=0.3, max_model_len=4096,
                                              extra_args=["--enforce-eager"]))  # faster start
    if shutil.which("vllm") is None:  # vllm installed as wheels on PYTHONPATH: no console script
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, *argv[3:]]
    log = open(tmp / "vllm.log", "w")
    proc = subprocess.Popen(argv, env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)
    out: dict = {"model": described, "command": " ".join(argv)}
    client = EngineClient(f"http://127.0.0.1:{port}", timeout=300)
    try:
        client.health(wait_s=420)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda().eval()
        fields = dict(max_tokens=32, temperature=1.0, seed=5, logprobs=True, return_token_ids=True, ignore_eos=True)
        a = client.chat(MESSAGES, **fields)
        checks = {}
        expected = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False))
        checks["prompt_ids_equal_template"] = a["prompt_token_ids"] == expected == client.tokenize(MESSAGES)
        stream_ids = [t for c in client.chat(MESSAGES, stream=True, **fields) for ch in c["choices"] for t in ch.get("token_ids") or []]
        checks["stream_equals_non_stream"] = stream_ids == a["choices"][0]["token_ids"]
        tools = [{"type": "function", "function": {"name": "ls", "description": "list files",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        checks["tools_accepted"] = bool(client.chat(MESSAGES, tools=tools, max_tokens=8)["choices"])
        try:
            client.chat(MESSAGES, max_tokens=10_000)
            checks["context_overflow_400"] = False
        except EngineHTTPError as exc:
            checks["context_overflow_400"] = exc.status == 400 and "maximum context length" in json.dumps(exc.body)
        ids = a["choices"][0]["token_ids"]
        got = torch.tensor([e["logprob"] for e in a["choices"][0]["logprobs"]["content"]])
        diff = (recompute(hf, a["prompt_token_ids"], ids) - got).abs()
        out["vllm_vs_trainer_logprob"] = {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item()}
        # One weight reload: perturbed weights written in Turnstile's checkpoint format.
        perturb(hf, 7)
        ckpt = save_weights(hf, tmp / "step-1", {"policy_version": 1})
        reloader = VLLMReloader(f"http://127.0.0.1:{port}")
        try:
            out["reload"] = reloader.reload(str(ckpt), 1)
        finally:
            reloader.close()
        b = client.chat(MESSAGES, **fields)
        got_b = torch.tensor([e["logprob"] for e in b["choices"][0]["logprobs"]["content"]])
        diff_b = (recompute(hf, b["prompt_token_ids"], b["choices"][0]["token_ids"]) - got_b).abs()
        out["after_reload_logprob"] = {"max_abs_diff": diff_b.max().item(), "mean_abs_diff": diff_b.mean().item()}
        checks["reload_followed"] = diff_b.max().item() < 1e-2
        out["checks"] = checks
        out["ok"] = all(checks.values())
    except Exception as exc:  # noqa: BLE001 (report, never hang the device)
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"
        log.flush()
        out["vllm_log_tail"] = (tmp / "vllm.log").read_text()[-3000:]
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("GPU check NOT RUN: no CUDA GPU visible to torch on this machine.")
        return 0
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    RESULTS["embedded_cuda"] = check_embedded_cuda()
    print("embedded engine on CUDA:", json.dumps(RESULTS["embedded_cuda"]))
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        RESULTS["vllm"] = {"ok": None, "not_run": "vllm is not installed here (pip install -r requirements-gpu.txt)"}
        print("vLLM check NOT RUN: vllm is not installed on this machine.")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            RESULTS["vllm"] = check_vllm(Path(tmp))
    print("SUMMARY " + json.dumps(RESULTS))
    return 0 if all(r.get("ok") is not False for r in RESULTS.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
