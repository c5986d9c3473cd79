"""Random-weight GGUFs of public model shapes, with the bundled model's tokenizer, for benchmarks at size.

    nice -n 19 .venv/bin/python bench/shapes.py [--shapes smollm2-360m smollm2-1.7b] [--types Q4_0-pure Q4_K_M Q8_0]
                                                [--check]

The bundled model (SmolLM2-135M-Instruct) is too small to say how a server does at the sizes people serve: its
weights fit a server CPU's L3 cache. This writes GGUFs with the shapes of larger public models (llama architecture,
tied embeddings, SmolLM2's 49,152-token vocabulary, rope theta and norm epsilon) and random weights: normal with
standard deviation 0.02 for the matrices, 1.0 for the norms. Speed does not depend on the values, and random ones
need no download; the greedy answers are meaningless, the same for both servers. The tokenizer (tokens, merges,
special ids, chat template) is copied from the bundled GGUF, so prompts of token ids 100..40000 mean the same
tokens to every file.

Each shape is written once as F16 (F32 norms), tensor by tensor, so a 1.7B file needs a few hundred MB of RAM, not
several GB; llama-quantize (from bench/build_llamacpp.sh, run here unless --llama-quantize is given) then makes the
siblings of --types: Q4_0 --pure (every tensor Q4_0, token embeddings included: what llama.cpp runs fastest on a
CPU, repacked at load into interleaved blocks), Q4_K_M and Q8_0 (llama.cpp's default mixtures; on request Q3_K_M,
IQ4_XS, Q5_K_M, IQ3_M, and IQ3_XXS, IQ2_XXS and IQ1_M, which llama-quantize makes only with an importance matrix:
given one where every input weighs the same, random weights having nothing to measure). Everything is cached in
$LMRPC_BENCH_CACHE/models (default ~/.cache/lmrpc-bench/models, where bench/build_llamacpp.sh puts its GGUFs); a
second run finds the files and only prints their paths, one `GGUF=<path>` line each.

--check starts lmrpc-server (--model FILE) and llama-server (-m FILE) on each file in turn and has each greedily
generate a few tokens from the same token-id prompt: that both load the file, and what they make of it.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import shapes_check

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
INIT_STD = 0.02  # the standard deviation of the random matrices (the models' initializer_range)
SEED = 0  # one fixed seed: a file rewritten is the same file


@dataclass(frozen=True)
class Shape:
    name: str  # what --shapes calls it, and the files' stem
    source: str  # the public model whose config this is
    hidden: int  # hidden_size (GGUF embedding_length)
    ffn: int  # intermediate_size (GGUF feed_forward_length)
    layers: int  # num_hidden_layers (GGUF block_count)
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    rope_theta: float  # rope.freq_base
    norm_eps: float  # rms_norm_eps
    context: int  # max_position_embeddings
    vocab: int = 49152  # SmolLM2's vocabulary (the bundled tokenizer's)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# The configs of the public models (config.json on the Hugging Face hub, HuggingFaceTB/SmolLM2-*-Instruct); all have
# tied embeddings and a head dimension of 64.
SHAPES = {s.name: s for s in (
    Shape("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", 576, 1536, 30, 9, 3, 100000.0, 1e-5, 8192),
    Shape("smollm2-360m", "HuggingFaceTB/SmolLM2-360M-Instruct", 960, 2560, 32, 15, 5, 100000.0, 1e-5, 8192),
    Shape("smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B-Instruct", 2048, 8192, 24, 32, 32, 130000.0, 1e-5, 8192),
)}
DEFAULT_SHAPES = ("smollm2-360m", "smollm2-1.7b")

# The quantized siblings: file suffix -> llama-quantize's type and flags.
QUANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Q4_0-pure": ("Q4_0", ("--pure",)),  # every tensor Q4_0: llama.cpp's fastest CPU configuration
    "Q4_K_M": ("Q4_K_M", ()),  # the mixture most published GGUFs use
    "Q8_0": ("Q8_0", ()),
    "Q3_K_M": ("Q3_K_M", ()),  # on request (--types): the smaller mixtures, Q3_K with Q4_K, Q5_K, Q6_K beside it
    "IQ4_XS": ("IQ4_XS", ()),  # the non-linear 4-bit format, made without an importance matrix
    "Q5_K_M": ("Q5_K_M", ()),  # on request: the 5-bit mixture (Q5_K, with Q6_K beside it)
    "IQ3_M": ("IQ3_M", ()),  # on request: the grid formats (IQ3_S, with Q4_K beside it), no importance matrix
    "IQ3_XXS": ("IQ3_XXS", ()),  # this and the IQ1 and IQ2 types: with a uniform importance matrix (uniform_imatrix)
    "IQ2_XXS": ("IQ2_XXS", ()),
    "IQ2_XS": ("IQ2_XS", ()),  # IQ2_XS and IQ2_M (IQ2_S beside others): grid formats with a scale per 16 weights
    "IQ2_M": ("IQ2_M", ()),
    "IQ1_M": ("IQ1_M", ()),
}
DEFAULT_TYPES = ("Q4_0-pure", "Q4_K_M", "Q8_0")
# llama-quantize refuses these without an importance matrix
NEEDS_IMATRIX = frozenset({"IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_M", "IQ1_M"})


# ---- where things are ------------------------------------------------------------------------------------------


def models_dir() -> Path:
    """The cache bench/build_llamacpp.sh keeps its GGUFs in (it and this script share it)."""
    cache = os.environ.get("LMRPC_BENCH_CACHE") or str(Path.home() / ".cache" / "lmrpc-bench")
    return Path(cache) / "models"


def gguf_path(shape: Shape, kind: str) -> Path:
    """kind: "F16" (the written file) or a key of QUANTS."""
    return models_dir() / f"{shape.name}-random-{kind}.gguf"


def bundled_gguf() -> Path:
    # Imported here: the loader imports torch (tens of seconds on a busy machine), not needed once files are cached.
    from lmrpc.server.models.loader import default_gguf

    return default_gguf()


def llamacpp_paths() -> dict[str, str]:
    """bench/build_llamacpp.sh's KEY=VALUE lines (LLAMA_SERVER, BF16_GGUF, Q4_0_GGUF): it builds llama.cpp on first use
    (tens of minutes) and is a no-op once cached."""
    print("shapes: bench/build_llamacpp.sh (builds llama.cpp on first use)", file=sys.stderr)
    out = subprocess.run([str(HERE / "build_llamacpp.sh")], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"shapes: bench/build_llamacpp.sh failed with status {out.returncode} (its errors above)")
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


# ---- writing the F16 file ------------------------------------------------------------------------------------------


def tensor_plan(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape: rows = outputs) of every tensor, in convert_hf_to_gguf.py's order. No output.weight:
    the embeddings are tied, as in the SmolLM2 models."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, h)
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight", (h,)
        yield f"blk.{i}.attn_q.weight", (q, h)
        yield f"blk.{i}.attn_k.weight", (kv, h)
        yield f"blk.{i}.attn_v.weight", (kv, h)
        yield f"blk.{i}.attn_output.weight", (h, q)
        yield f"blk.{i}.ffn_norm.weight", (h,)
        yield f"blk.{i}.ffn_gate.weight", (shape.ffn, h)
        yield f"blk.{i}.ffn_up.weight", (shape.ffn, h)
        yield f"blk.{i}.ffn_down.weight", (h, shape.ffn)
    yield "output_norm.weight", (h,)


def tensor_dtype(dims: tuple[int, ...]) -> type[np.floating[Any]]:
    # Norms stay F32 as llama.cpp's converter writes them (and llama-quantize keeps 1-D tensors unquantized).
    return np.float32 if len(dims) == 1 else np.float16


def make_tensor(dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray[Any, Any]:
    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)
    # Generated in float32 (numpy has no float16 normal sampler), scaled in place, narrowed: one float32 copy of the
    # largest tensor (the 1.7B's embeddings: 400 MB) is the peak.
    values = rng.standard_normal(dims, dtype=np.float32)
    values *= INIT_STD
    return values.astype(np.float16)


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every tokenizer.* key of the bundled GGUF, with its own value types (token_type stays INT32, ids UINT32)."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)


def add_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    writer.add_type("model")
    writer.add_name(f"{shape.name} random weights (shape of {shape.source})")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.norm_eps)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def write_random_gguf(shape: Shape, tokenizer_gguf: Path, out: Path) -> None:
    """The F16 file, streamed: the header and every tensor's info first (sizes are known from the shapes), then each
    tensor generated, written and dropped before the next (GGUFWriter.add_tensor would keep them all)."""
    reader = gguf.GGUFReader(tokenizer_gguf)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab != shape.vocab:
        raise SystemExit(f"shapes: {tokenizer_gguf} has {vocab} tokens, {shape.name} wants {shape.vocab}")
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch="llama")
    add_metadata(writer, shape)
    copy_tokenizer(reader, writer)
    plan = list(tensor_plan(shape))
    for name, dims in plan:
        dtype = np.dtype(tensor_dtype(dims))
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(SEED)
    for _, dims in plan:
        writer.write_tensor_data(make_tensor(dims, rng))
    writer.close()
    tmp.rename(out)  # only a complete file gets the final name


def quantize(llama_quantize: str, source: Path, out: Path, kind: str) -> None:
    qtype, flags = QUANTS[kind]
    if kind in NEEDS_IMATRIX:
        flags = (*flags, "--imatrix", str(uniform_imatrix(source)))
    run_quantize([llama_quantize, *flags, str(source)], qtype, out)


def uniform_imatrix(source: Path) -> Path:
    """An importance matrix in llama.cpp's legacy file format (entries: int32 name length, name, int32 calls, int32
    values, float32 values) giving every input of every matrix of `source` the weight 1: cached beside it."""
    out = source.with_name(source.stem + ".uniform-imatrix.dat")
    if out.exists():
        return out
    matrices = [(t.name, int(t.shape[0])) for t in gguf.GGUFReader(source).tensors if len(t.shape) == 2]
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<i", len(matrices)))
        for name, inputs in matrices:  # a GGUF shape lists the inputs (the innermost dimension) first
            f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, inputs))
            f.write(np.ones(inputs, dtype=np.float32).tobytes())
    tmp.rename(out)
    return out


def run_quantize(command: list[str], qtype: str, out: Path) -> None:
    """command (llama-quantize, its flags and the source) + a temporary output + qtype; only a complete file gets
    the name `out`. The log is kept only on failure."""
    tmp = out.with_name(out.name + ".tmp")
    log = out.with_suffix(".log")
    with log.open("w") as f:
        done = subprocess.run([*command, str(tmp), qtype], stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"shapes: llama-quantize failed for {out.name} (log {log}):\n{tail}")
    log.unlink()
    tmp.rename(out)


def ensure_files(shapes: list[Shape], kinds: list[str], llama_quantize: str | None) -> list[Path]:
    """Every requested file, written or quantized unless cached; the paths in order (per shape: F16, then kinds)."""
    models_dir().mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for shape in shapes:
        f16 = gguf_path(shape, "F16")
        if not f16.exists():
            print(f"shapes: writing {f16}", file=sys.stderr)
            start = time.perf_counter()
            write_random_gguf(shape, bundled_gguf(), f16)
            print(f"shapes: wrote {f16.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr)
        paths.append(f16)
        for kind in kinds:
            out = gguf_path(shape, kind)
            if not out.exists():
                if llama_quantize is None:
                    llama_quantize = str(Path(llamacpp_paths()["LLAMA_SERVER"]).with_name("llama-quantize"))
                print(f"shapes: quantizing {f16.name} to {kind}", file=sys.stderr)
                quantize(llama_quantize, f16, out, kind)
            paths.append(out)
    return paths


# ---- other files of a model (bench/served.py uses these) -----------------------------------------------------------


def decode_weight_bytes(path: Path) -> int:
    """The weight bytes one decode step reads, as the file stores them (packed quantized blocks included): every
    tensor, but an untied model's token_embd only gives one row per token (its output.weight is read whole); a tied
    one reads token_embd whole as the output head."""
    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def is_q4_0_pure(path: Path) -> bool:
    """Every matrix in Q4_0 (1-D tensors, the norms, stay F32 in any GGUF)."""
    return all(t.tensor_type == gguf.GGMLQuantizationType.Q4_0
               for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1)


def q4_0_pure_sibling(path: Path) -> Path | None:
    """The Q4_0 --pure file of the same model if there is one at hand: the file itself, or, for a file this script
    wrote, its -random-Q4_0-pure sibling (quantized from the F16 original, not requantized)."""
    if is_q4_0_pure(path):
        return path
    stem, sep, _ = path.name.rpartition("-random-")
    sibling = path.with_name(f"{stem}-random-Q4_0-pure.gguf")
    return sibling if sep and sibling.is_file() else None


def requantize(llama_quantize: str, source: Path, qtype: str, pure: bool = False) -> Path:
    """source requantized to qtype, made once into models_dir() as bench/build_llamacpp.sh names its files
    (<stem>-to-BF16.gguf, <stem>-to-Q4_0-pure.gguf): for the bundled model these are the build script's own."""
    out = models_dir() / f"{source.stem}-to-{qtype}{'-pure' if pure else ''}.gguf"
    if not out.exists():
        print(f"shapes: requantizing {source.name} to {out.name}", file=sys.stderr)
        models_dir().mkdir(parents=True, exist_ok=True)
        run_quantize([llama_quantize, "--allow-requantize", *(["--pure"] if pure else []), str(source)], qtype, out)
    return out


# ---- main ----------------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(DEFAULT_SHAPES),
                   help=f"model shapes to write ({' '.join(DEFAULT_SHAPES)})")
    p.add_argument("--types", nargs="*", choices=list(QUANTS), default=list(DEFAULT_TYPES),
                   help=f"quantized siblings to make with llama-quantize, of {' '.join(QUANTS)} (default "
                   f"{' '.join(DEFAULT_TYPES)}; none: F16 only)")
    p.add_argument("--llama-quantize", help="llama-quantize binary (default: from bench/build_llamacpp.sh)")
    p.add_argument("--check", action="store_true",
                   help="start lmrpc-server and llama-server on every file and generate a few tokens")
    p.add_argument("--check-f16", action="store_true", help="with --check: the F16 files too (lmrpc widens them "
                   "to float32 or bfloat16: 4 bytes per weight on a CPU without AVX512-BF16)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t in --check")
    args = p.parse_args()
    paths = ensure_files([SHAPES[name] for name in args.shapes], args.types, args.llama_quantize)
    for path in paths:
        print(f"shapes: {path.name}: {decode_weight_bytes(path) / 2**30:.3f} GiB of weights", file=sys.stderr)
    if args.check:
        llama_server = llamacpp_paths()["LLAMA_SERVER"]
        for path in paths:
            if path.name.endswith("-F16.gguf") and not args.check_f16:
                continue
            print(f"shapes: check {path.name}", file=sys.stderr)
            print(f"shapes:   {shapes_check.check_lmrpc(path)}", file=sys.stderr)
            print(f"shapes:   {shapes_check.check_llama(llama_server, path, args.threads)}", file=sys.stderr)
    for path in paths:
        print(f"GGUF={path}")


if __name__ == "__main__":
    main()
