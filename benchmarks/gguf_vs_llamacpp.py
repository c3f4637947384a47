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

``--synth-config CONFIG`` takes the source model from ``moestream synth`` instead (the realistic case: a
real config's shapes, ``--layers`` decoder layers, ``--init trained`` weights and routing, written in bf16 so
the F32 GGUF is an exact upcast); files are named ``synth-*.gguf`` and the default text is a varied
passage of several hundred tokens. Each file is also run through moestream in bf16 (``bf16`` entries) beside
float32. Per comparison: argmax agreement, max / median / mean |logit difference|, the same relative to the
largest |logit| of the reference, and the reference's top-1 minus top-2 margin at the positions whose
argmax differs (small margins: the disagreement is rounding, not a bug).
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
sys.path.insert(0, sys.argv[2])  # the checkout: the tests' weight redraw
from tests.helpers import NORMS, ROUTERS, redraw_
cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                     num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6,
                     tie_word_embeddings=False, initializer_range=0.05, torch_dtype="float32",
                     bos_token_id=151643, eos_token_id=151645)
torch.manual_seed(0)
m = Qwen3MoeForCausalLM(cfg).eval()
redraw_(m.named_parameters(), NORMS, ROUTERS, (lambda n, p: True, 0.0, 0.05))
m.save_pretrained(sys.argv[1], safe_serialization=True)
'''

LLAMA = r'''
import ctypes, json, os, sys
import numpy as np
import llama_cpp
src, q4, tokens_file, out_dir = sys.argv[1:5]
if not os.path.exists(q4):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(src.encode(), q4.encode(), ctypes.byref(params)) == 0
tokens = json.load(open(tokens_file))
if os.environ.get("LLAMA_REPACK", "on") == "off":  # llama-cpp-python takes no use_extra_bufts: its defaults, patched
    default = llama_cpp.llama_cpp.llama_model_default_params

    def no_repack():
        params = default()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = no_repack
n_ctx = max(256, -(-len(tokens) // 256) * 256)  # whole prompt in one batch, every position's logits kept
for path in sys.argv[5:]:
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, logits_all=True, n_threads=2, verbose=False, n_batch=n_ctx,
                          n_ubatch=n_ctx)
    assert bool(llm.model_params.use_extra_bufts) == (os.environ.get("LLAMA_REPACK", "on") == "on")
    llm.eval(tokens)
    np.save(f"{out_dir}/{path.rsplit('/', 1)[1]}.npy", np.array(llm.scores[: len(tokens)], dtype=np.float32))
'''


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd[:4]), "...", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


# A varied passage (prose, code, numbers, a list, other languages) for the synth mode: several hundred tokens.
VARIED_TEXT = (
    "In the spring of 1887, the engineer Margarethe Kollwitz arrived in Lisbon with two trunks of drawings and "
    "a letter of introduction that nobody at the harbour office could read. She spent the first week measuring "
    "the tides by hand, writing every reading in a small green notebook: 2.31 m at dawn, 0.87 m at noon, 3.02 m "
    "the following night. By the end of the month she had a table of 412 readings and a theory about the silt.\n\n"
    "def moving_average(xs, k=3):\n"
    "    \"\"\"Return the running mean of xs over windows of k values.\"\"\"\n"
    "    out = []\n"
    "    for i in range(len(xs) - k + 1):\n"
    "        out.append(sum(xs[i:i + k]) / k)\n"
    "    return out\n\n"
    "Shopping list: flour (2 kg), eggs x12, olive oil, fresh basil, 3 lemons, dark chocolate (70%), coffee beans.\n"
    "Q: What is the capital of Australia? A: Canberra, not Sydney, although many people guess Sydney first.\n"
    "Le petit village se trouvait au bord de la riviere, entoure de champs de lavande et de vieux oliviers. "
    "Der Zug nach Berlin hat heute leider zwanzig Minuten Verspaetung. El mercado abre a las ocho de la manana.\n"
    "SELECT name, COUNT(*) AS n FROM orders WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY n DESC;\n"
    "The derivative of x^3 + 2x^2 - 5x + 7 is 3x^2 + 4x - 5, and its integral from 0 to 1 equals 1/4 + 2/3 - 5/2 "
    "+ 7 = 5.4166... Meanwhile, the committee voted 7 to 4 to postpone the decision until the autumn session, "
    "citing the unresolved questions about funding, staffing and the long-term maintenance of the new bridge.\n"
    "<html><body><h1>Welcome!</h1><p>Click <a href=\"/login\">here</a> to sign in.</p></body></html>\n"
    "Kollwitz's report, published two years later, argued that the harbour could be saved by dredging a single "
    "channel along the northern wall, at roughly a third of the cost of the plan the city had already approved."
)


def write_synth_source(hf: Path, config: Path, layers: int | None, init: str, dtype: str) -> None:
    """Write a ``moestream synth`` checkpoint (bundled Qwen3 tokenizer) into the new folder ``hf``."""
    from moestream.synth import plan_synth, write_synth

    write_synth(plan_synth(config, layers, dtype, 0, None, init), hf)


# The activation blocks llama.cpp's CPU dot products quantize a linear's input to, by weight type (ggml's
# type_traits_cpu vec_dot_type): Q8_0 blocks of 32 for the legacy types, Q8_K blocks of 256 for the K-quants.
ACT_BLOCKS = {"Q4_0": "Q8_0", "Q4_1": "Q8_1", "Q5_0": "Q8_0", "Q5_1": "Q8_1", "Q8_0": "Q8_0",
              "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K"}


def quantize_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` [n, in] float32 rounded as llama.cpp's ``quantize_row_q8_0`` / ``q8_1`` / ``q8_K`` do, dequantized.

    Q8_0 / Q8_1: blocks of 32, scale ``amax / 127`` stored as fp16, codes ``round(x / scale)``; Q8_K: blocks
    of 256, scale ``max / -127`` (``max`` the value of largest magnitude) kept in float32. ``in`` must be a
    multiple of the block. Ties round half away from zero here (ggml's SIMD paths round half to even: the
    odd code of difference).
    """
    block = 256 if kind == "Q8_K" else 32
    xb = x.float().reshape(x.shape[0], -1, block)
    if kind == "Q8_K":
        idx = xb.abs().argmax(-1, keepdim=True)
        mx = xb.gather(-1, idx)
        iscale = torch.where(mx == 0, torch.zeros_like(mx), -127.0 / mx)
        q = torch.round(xb * iscale).clamp(max=127)
        d = torch.where(iscale == 0, torch.zeros_like(iscale), 1.0 / iscale)
    else:
        d = xb.abs().amax(-1, keepdim=True) / 127.0
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = torch.sign(xb * inv) * torch.floor((xb * inv).abs() + 0.5)
        d = d.half().float()
    return (q * d).reshape(x.shape).to(x.dtype)


class ActivationQuantEmulation:
    """While entered, moestream's GGUF linears see their input rounded as llama.cpp's CPU dot products do.

    Wraps :func:`moestream.quant.native.linear` (every GGUF linear, resident or expert, passes through it)
    and turns off the fused expert kernel (:func:`moestream.quant.native.swiglu`, whose down projection
    takes an intermediate never seen outside it), so the expert runs as three linears.
    """

    def __enter__(self):
        from moestream.quant import native

        self.native, self.saved = native, (native.linear, native.swiglu)
        linear = native.linear

        def emulated(x, t, lf, *a, **k):
            s = lf.scheme
            if s is not None and s.method == "gguf" and s.ggml in ACT_BLOCKS:
                x = quantize_activations(x, ACT_BLOCKS[s.ggml])
            return linear(x, t, lf, *a, **k)

        native.linear, native.swiglu = emulated, lambda *a, **k: None
        return self

    def __exit__(self, *exc):
        self.native.linear, self.native.swiglu = self.saved


def moestream_logits(path: Path, tokens: list[int], dtype: str = "float32", activations: str = "float") -> np.ndarray:
    """Every position's logits, float32 numpy ``(len(tokens), vocab)``, computed in ``dtype`` with
    ``activations`` (``q8``: llama.cpp's 8-bit activation blocks, moestream's ``--activations q8``)."""
    from moestream.engine import load

    # float32 by default as llama.cpp computes its activations (moestream's GGUF default is bf16)
    engine = load(path, cache_budget_gb="0", tokenizer=False, workers=2, dtype=dtype, activations=activations)
    try:
        with torch.inference_mode():
            ids = torch.tensor(tokens)
            return engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True).float().numpy()
    finally:
        engine.close()


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """``a`` against the reference ``b`` (both ``(positions, vocab)`` float32).

    Relative differences are to the reference's largest |logit|; ``margin_*`` is the reference's top-1
    minus top-2 logit, at every position and at those whose argmax differs.
    """
    differ = a.argmax(-1) != b.argmax(-1)
    diff = np.abs(a - b)
    top2 = np.sort(np.partition(b, -2, axis=-1)[:, -2:], axis=-1)
    margin = top2[:, 1] - top2[:, 0]
    scale = float(np.abs(b).max())
    return {"argmax_agreement": float((~differ).mean()), "disagreements": int(differ.sum()),
            "max_abs_diff": float(diff.max()), "median_abs_diff": float(np.median(diff)),
            "mean_abs_diff": float(diff.mean()), "max_abs_logit": scale,
            "max_rel_diff": float(diff.max()) / scale, "median_rel_diff": float(np.median(diff)) / scale,
            "margin_median": float(np.median(margin)),
            "margin_at_disagreements": [round(float(m), 5) for m in margin[differ]],
            "max_abs_diff_at_disagreements": float(diff[differ].max()) if differ.any() else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--convert-python", required=True)
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--text", default=None, help="text to feed (default: a repeated pangram; --synth-config: a "
                    "varied passage)")
    ap.add_argument("--synth-config", type=Path, default=None,
                    help="take the source model from moestream synth of this config.json (default: a random "
                    "transformers Qwen3-MoE, every linear 256 wide)")
    ap.add_argument("--layers", type=int, default=1, help="synth: decoder layers to keep (default 1)")
    ap.add_argument("--init", default="trained", choices=["spread", "plain", "trained"],
                    help="synth: weight init (default trained)")
    ap.add_argument("--synth-dtype", default="bf16", choices=["bf16", "fp32"],
                    help="synth: checkpoint dtype (default bf16; the F32 GGUF is then an exact upcast)")
    ap.add_argument("--float-type", default="f32", choices=["f32", "bf16"],
                    help="the float GGUF's type (default f32); Q4_K_M is quantized from it")
    ap.add_argument("--no-bf16", action="store_true", help="skip moestream's bf16 runs")
    ap.add_argument("--emulate-act-quant", action="store_true",
                    help="also run the quantized files with llama.cpp's 8-bit activation rounding emulated")
    ap.add_argument("--activations", default="float", choices=["float", "q8"],
                    help="q8: also run the quantized files in moestream's --activations q8 mode (llama.cpp's "
                    "8-bit activation blocks and integer dot products), reported as q8_vs_llama_cpp")
    ap.add_argument("--llama-repack", default="on", choices=["on", "off"],
                    help="llama.cpp's CPU repack / AMX buffers (use_extra_bufts; default on). off: its plain CPU "
                    "dot products (quantize_row_q8_K + vec_dot_*_q8_K), what --activations q8 follows; on an AMX "
                    "Xeon the AMX path crashed (SIGSEGV) on the synth's Q8_0 and Q4_K_M files")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    out = args.out
    hf = out / "hf"
    out.mkdir(parents=True, exist_ok=True)
    synth = args.synth_config is not None
    text = args.text if args.text is not None else (
        VARIED_TEXT if synth else "The quick brown fox jumps over the lazy dog. " * 6)
    if synth and not (hf / "config.json").exists():
        write_synth_source(hf, args.synth_config, args.layers, args.init, args.synth_dtype)
    elif not (hf / "config.json").exists():
        run([args.convert_python, "-c", MAKE, str(hf), str(Path(__file__).resolve().parents[1])])
        from moestream.tokenizer import BUNDLED_QWEN3

        for f in BUNDLED_QWEN3.iterdir():
            shutil.copy(f, hf / f.name)
    convert = str(args.llama_cpp / "convert_hf_to_gguf.py")
    gguf_py = {"PYTHONPATH": str(args.llama_cpp / "gguf-py")}
    prefix, ft = ("synth" if synth else "tiny"), args.float_type
    files = {t: out / f"{prefix}-{t}.gguf" for t in (ft, "q8_0", "q4_k_m")}
    for t in (ft, "q8_0"):
        if not files[t].exists():
            run([args.convert_python, convert, str(hf), "--outtype", t, "--outfile", str(files[t])], gguf_py)

    from moestream.tokenizer import load_tokenizer

    tok_gguf, tok_hf = load_tokenizer(files[ft]), load_tokenizer(hf)
    tokens = tok_hf.encode(text, add_special_tokens=False)
    tokens_file = out / "tokens.json"
    same_tokens = tokens_file.exists() and json.loads(tokens_file.read_text()) == tokens
    tokens_file.write_text(json.dumps(tokens))
    results = {"source": (f"moestream synth {args.synth_config.name} --layers {args.layers} --init {args.init} "
                          f"--dtype {args.synth_dtype}") if synth else "random transformers Qwen3-MoE, 256 wide",
               "tokens": len(tokens), "tokenizer_from_gguf_matches_folder":
               tok_gguf.encode(text, add_special_tokens=False) == tokens, "llama_repack": args.llama_repack}
    if not (same_tokens and all((out / f"{f.name}.npy").exists() for f in files.values())):  # else reuse
        run([args.llama_python, "-c", LLAMA, str(files[ft]), str(files["q4_k_m"]), str(tokens_file), str(out),
             *(str(f) for f in files.values())], {"LLAMA_REPACK": args.llama_repack})
    float_path = moestream_logits(hf, tokens)
    results[f"moestream_hf_float_vs_gguf_{ft}"] = compare(moestream_logits(files[ft], tokens), float_path)
    for t, f in files.items():
        llama = np.load(out / f"{f.name}.npy")
        ours = moestream_logits(f, tokens)
        results[t] = {"vs_llama_cpp": compare(ours, llama), "llama_cpp_vs_float": compare(llama, float_path),
                      "moestream_vs_float": compare(ours, float_path)}
        if not args.no_bf16:
            ours16 = moestream_logits(f, tokens, "bf16")
            results[t]["bf16_vs_llama_cpp"] = compare(ours16, llama)
            results[t]["bf16_vs_float"] = compare(ours16, float_path)
        if args.activations == "q8" and t != ft:
            q8 = moestream_logits(f, tokens, activations="q8")
            results[t]["q8_vs_llama_cpp"] = compare(q8, llama)
            results[t]["q8_vs_float"] = compare(q8, float_path)
            results[t]["q8_vs_moestream_float"] = compare(q8, ours)
        if args.emulate_act_quant and t != ft:
            with ActivationQuantEmulation():
                emu = moestream_logits(f, tokens)
            results[t]["act_quant_emulated_vs_llama_cpp"] = compare(emu, llama)
        print(t, json.dumps({k: {m: v[m] for m in ("argmax_agreement", "max_abs_diff", "median_abs_diff")}
                             for k, v in results[t].items()}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
