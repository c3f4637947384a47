"""moestream on GGUF files made by llama.cpp's own tools, against llama.cpp itself, fed the same tokens (CPU).

A random Qwen3-MoE (every linear 256 wide, so the K-quants apply everywhere; Qwen3's tokenizer) is saved
by transformers, converted by llama.cpp's ``convert_hf_to_gguf.py`` (F32 and Q8_0), and quantized by
``llama_model_quantize`` (Q4_K_M) through llama-cpp-python. For each file: llama.cpp's logits of every
position (``logits_all``) and moestream's (expert cache budget 0: every expert streamed from the file),
the share of positions whose argmax agrees and the largest logit difference; also the Hugging Face
folder through moestream's float path against the F32 GGUF, and the GGUF tokenizer (transformers, from
the file's metadata) against the folder's.

Needs the bench set-up's environments (``benchmarks/peers``): ``--convert-python`` with torch and
transformers for llama.cpp's converter, ``--llama-python`` with llama-cpp-python, ``--llama-cpp`` the
llama.cpp source tree. Run with moestream's own interpreter:

    python benchmarks/gguf_vs_llamacpp.py --out /tmp/gguf-bench \\
        --convert-python /work/big/peers/convert-venv/bin/python --llama-python /work/big/peers/venv/bin/python \\
        --llama-cpp /work/big/peers/src/vendor/llama.cpp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

MAKE = r'''
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                     num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6,
                     tie_word_embeddings=False, initializer_range=0.05, torch_dtype="float32",
                     bos_token_id=151643, eos_token_id=151645)
torch.manual_seed(0)
m = Qwen3MoeForCausalLM(cfg).eval()
with torch.no_grad():
    for n, p in m.named_parameters():
        if "norm" in n:
            p.normal_(1.0, 0.2)
        elif n.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.5)
        else:
            p.normal_(0.0, 0.05)
m.save_pretrained(sys.argv[1], safe_serialization=True)
'''

LLAMA = r'''
import ctypes, json, sys
import numpy as np
import llama_cpp
src, q4, tokens_file, out_dir = sys.argv[1:5]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = 2
assert llama_cpp.llama_model_quantize(src.encode(), q4.encode(), ctypes.byref(params)) == 0
tokens = json.load(open(tokens_file))
for path in sys.argv[5:]:
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, logits_all=True, n_threads=2, verbose=False, n_batch=256)
    llm.eval(tokens)
    np.save(f"{out_dir}/{path.rsplit('/', 1)[1]}.npy", np.array(llm.scores[: len(tokens)], dtype=np.float32))
'''


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd[:4]), "...", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def moestream_logits(path: Path, tokens: list[int]) -> np.ndarray:
    from moestream.engine import load

    # float32 as llama.cpp computes its activations (and as docs/gguf.md's table was measured; the default is bf16)
    engine = load(path, cache_budget_gb="0", tokenizer=False, workers=2, dtype="float32")
    try:
        with torch.inference_mode():
            ids = torch.tensor(tokens)
            return engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True).float().numpy()
    finally:
        engine.close()


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    agree = float((a.argmax(-1) == b.argmax(-1)).mean())
    diff = np.abs(a - b)
    return {"argmax_agreement": agree, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "max_abs_logit": float(np.abs(b).max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--convert-python", required=True)
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--text", default="The quick brown fox jumps over the lazy dog. " * 6)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    out = args.out
    hf = out / "hf"
    out.mkdir(parents=True, exist_ok=True)
    if not (hf / "config.json").exists():
        run([args.convert_python, "-c", MAKE, str(hf)])
        from moestream.tokenizer import BUNDLED_QWEN3

        for f in BUNDLED_QWEN3.iterdir():
            shutil.copy(f, hf / f.name)
    convert = str(args.llama_cpp / "convert_hf_to_gguf.py")
    gguf_py = {"PYTHONPATH": str(args.llama_cpp / "gguf-py")}
    files = {t: out / f"tiny-{t}.gguf" for t in ("f32", "q8_0", "q4_k_m")}
    for t in ("f32", "q8_0"):
        if not files[t].exists():
            run([args.convert_python, convert, str(hf), "--outtype", t, "--outfile", str(files[t])], gguf_py)

    from moestream.tokenizer import load_tokenizer

    tok_gguf, tok_hf = load_tokenizer(files["f32"]), load_tokenizer(hf)
    tokens = tok_hf.encode(args.text, add_special_tokens=False)
    (out / "tokens.json").write_text(json.dumps(tokens))
    results = {"tokens": len(tokens), "tokenizer_from_gguf_matches_folder":
               tok_gguf.encode(args.text, add_special_tokens=False) == tokens}
    run([args.llama_python, "-c", LLAMA, str(files["f32"]), str(files["q4_k_m"]), str(out / "tokens.json"), str(out),
         *(str(f) for f in files.values())])
    float_path = moestream_logits(hf, tokens)
    results["moestream_hf_float_vs_gguf_f32"] = compare(moestream_logits(files["f32"], tokens), float_path)
    for t, f in files.items():
        llama = np.load(out / f"{f.name}.npy")
        ours = moestream_logits(f, tokens)
        results[t] = {"vs_llama_cpp": compare(ours, llama), "llama_cpp_vs_float": compare(llama, float_path),
                      "moestream_vs_float": compare(ours, float_path)}
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
