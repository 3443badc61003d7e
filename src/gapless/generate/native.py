"""Native CPU kernels for the engine's decode step, compiled from `native.c` on first use.

Kernels (`native.c`): one decode step's attention for every running slot (RoPE on the new query
and key, the key and value written into the slot's cache, attention over exactly that slot's
positions, or the last `window` of them for sliding-window layers); RMSNorm rows; inverse-CDF sampling of untruncated
rows. In the torch path the same work is about 15 dispatched ops per
layer (norm, RoPE, an advanced-index cache write, a mask, batched matmuls, softmax), each a few
microseconds on tiny tensors and single-threaded below torch's parallel grain; here it is one
call, parallel over slots x KV heads, reading each slot's own length. And the engine's matmuls
(`linear`), on weights packed in panels of 16 output columns: at decode's few rows a matmul
streams its weights once, and this kernel uses each loaded weight for every row of a tile (8 rows
x 32 columns where the compiler targets AVX-512, 6 x 16 elsewhere).

Build: the system C compiler (`$CC`, else `cc`) compiles the file once per source, flags,
compiler and CPU (it uses -march=native) into `$GAPLESS_KERNEL_CACHE` (default
`~/.cache/gapless/kernels`); every later process loads the cached library (a compile takes
under a second). Where torch's parallel backend is OpenMP the library is built with -fopenmp:
it binds to the OpenMP runtime torch has already loaded and runs `torch.get_num_threads()`
threads. Elsewhere it is built single-threaded.

Modes (`generator.kernels`): 'auto' (default) uses the kernels when they build and otherwise
falls back to the torch path with one warning; 'native' makes a failed build an error; 'torch'
never builds them. Only fp32 on CPU uses them.

Guaranteed: results equal the torch path within fp32 rounding (the engine's tests run on both).
Not guaranteed: bitwise equality with it (sums run in another order).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MODES = ("auto", "native", "torch")
SOURCE = Path(__file__).with_name("native.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC"]


class NativeBuildError(RuntimeError):
    """The kernels could not be compiled or loaded; the message says what to do."""


class NativeKernels:
    """ctypes bindings of the compiled library. Tensors must be fp32, contiguous, on CPU."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        i64, ptr, f32, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._rms_norm = library.gl_rms_norm
        self._rms_norm.argtypes = [ptr, ptr, i64, i64, f32, cint]
        self._rms_norm.restype = None
        self._attend = library.gl_decode_attend
        self._attend.argtypes = [ptr] * 7 + [i64] * 5 + [f32, i64, cint]
        self._attend.restype = cint
        self._sample = library.gl_sample_rows
        self._sample.argtypes = [ptr] * 6 + [i64, i64, cint]
        self._sample.restype = None
        self._head_norm = library.gl_head_norm
        self._head_norm.argtypes = [ptr] * 3 + [i64] * 4 + [f32, cint]
        self._head_norm.restype = None
        self._linear = library.gl_linear
        self._linear.argtypes = [ptr] * 5 + [i64] * 3 + [cint, cint]
        self._linear.restype = None

    @staticmethod
    def pack_linear(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """W (N, K) -> the panel layout `linear` reads: (panels, K, 16), zero past N. `gated`: W is
        gate | up stacked (2n, K); each panel holds 8 gate columns then the same 8 up columns."""
        rows, k = weight.shape
        cols = 8 if gated else 16  # output columns per panel
        n = rows // 2 if gated else rows
        halves = weight.view(2 if gated else 1, n, k)
        if n % cols:  # zero rows up to whole panels (a copy; aligned shapes are packed in one)
            halves = torch.cat([halves, halves.new_zeros(halves.shape[0], -n % cols, k)], dim=1)
        # (halves, panels, cols, k) -> (panels, k, halves, cols): panel p = k rows of [gate | up] columns
        return halves.view(halves.shape[0], -1, cols, k).permute(1, 3, 0, 2).reshape(-1, k, 16).contiguous()

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_dim: int,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        gated: bool = False,
    ) -> torch.Tensor:
        """x (..., K) @ W.T (+ bias) (+ residual, shaped like the result) with W packed by
        `pack_linear`; `gated` (W packed with gated=True, bias the stacked gate | up bias):
        silu(x @ gate.T) * (x @ up.T), `out_dim` = n. fp32 on CPU."""
        k = packed.shape[1]
        if x.shape[-1] != k or packed.shape[0] * (8 if gated else 16) < out_dim or (gated and residual is not None):
            raise ValueError(
                f"linear: input {tuple(x.shape)} does not match packed weights {tuple(packed.shape)} for {out_dim} outputs"
            )
        x = x.contiguous()
        rows = x.numel() // k
        out = x.new_empty(*x.shape[:-1], out_dim)
        if residual is not None:
            residual = residual.contiguous()
            if residual.shape != out.shape:
                raise ValueError(
                    f"linear: residual {tuple(residual.shape)} does not match the output {tuple(out.shape)}"
                )
        bias = None if bias is None else bias.contiguous()  # held while the kernel runs
        self._linear(
            x.data_ptr(),
            packed.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            out.data_ptr(),
            rows,
            k,
            out_dim,
            int(gated),
            torch.get_num_threads(),
        )
        return out

    def head_norm(
        self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int, kv_heads: int, eps: float
    ) -> torch.Tensor:
        """In place: each query and key head of a contiguous (B, (heads + 2 kv_heads) * hd) tensor
        RMS-normalised over hd and scaled by q_weight / k_weight (hd,); values untouched."""
        hd = q_weight.shape[0]
        if not qkv.is_contiguous() or qkv.shape[-1] != (heads + 2 * kv_heads) * hd or k_weight.shape != q_weight.shape:
            raise ValueError(f"head_norm: qkv {tuple(qkv.shape)} does not match {heads} + 2 x {kv_heads} heads of {hd}")
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
        self._head_norm(
            qkv.data_ptr(),
            q_weight.data_ptr(),
            k_weight.data_ptr(),
            qkv.numel() // qkv.shape[-1],
            heads,
            kv_heads,
            hd,
            eps,
            torch.get_num_threads(),
        )
        return qkv

    def rms_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x**2, -1) + eps) over the last dim of a contiguous fp32 tensor."""
        out = torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, torch.get_num_threads()
        )
        return out

    def sample_rows(
        self, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse-CDF sampling without truncation: logits (B, V), temperature and u (B,) ->
        tokens (B,) int64 and their log-probs under softmax(logits / T) (B,)."""
        logits, temperature, u = logits.float().contiguous(), temperature.float().contiguous(), u.float().contiguous()
        rows, vocab = logits.shape
        tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
        scratch = torch.empty_like(logits)
        self._sample(
            logits.data_ptr(),
            temperature.data_ptr(),
            u.data_ptr(),
            scratch.data_ptr(),
            tokens.data_ptr(),
            logprobs.data_ptr(),
            rows,
            vocab,
            torch.get_num_threads(),
        )
        return tokens, logprobs

    def decode_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        heads: int,
        kv_heads: int,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """qkv (B, (heads + 2 kv_heads) * hd); positions (B,) int64; keys/values one layer's cache
        (slots >= B, kv_heads, max_len, hd), written at each slot's position; `window` > 0 attends
        only to the last `window` positions (sliding window). Returns (B, heads * hd)."""
        batch, hd = qkv.shape[0], keys.shape[-1]
        if qkv.shape != (batch, (heads + 2 * kv_heads) * hd) or not (
            qkv.is_contiguous() and keys.is_contiguous() and values.is_contiguous()
        ):
            raise ValueError(
                f"decode_attend: qkv {tuple(qkv.shape)} and cache {tuple(keys.shape)} do not match {heads} heads, "
                f"{kv_heads} KV heads (contiguous tensors needed)"
            )
        out = torch.empty(batch, heads * hd, dtype=qkv.dtype)
        status = self._attend(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin_signed.data_ptr(),
            positions.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            out.data_ptr(),
            batch,
            heads,
            kv_heads,
            hd,
            keys.shape[2],
            scale,
            window,
            torch.get_num_threads(),
        )
        if status:
            raise MemoryError("native decode attention: out of memory for its per-slot scratch")
        return out


def kernels_for(mode: str, dtype: torch.dtype, device: torch.device) -> NativeKernels | None:
    """The kernels for `mode` (see module docstring), or None for the torch path."""
    if mode not in MODES:
        raise ValueError(f"kernels: {mode!r} is not one of {MODES}")
    if mode == "torch":
        return None
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        if mode == "native":
            raise NativeBuildError(
                f"generator.kernels = 'native' runs fp32 on CPU only, not {dtype} on {device}; use 'auto'"
            )
        return None
    try:
        return load()
    except NativeBuildError as err:
        if mode == "native":
            raise
        _warn_once(str(err))
        return None


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("%s; the engine runs its torch path (slower decode, same results)", message)


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> NativeKernels:
    """Build (or find in the cache) and load the library; raises NativeBuildError. `extra_flags`
    go after the default ones (the tests build the AVX2 tile on an AVX-512 CPU with
    ('-mno-avx512f',) to check that both tile shapes give the same bits)."""
    path = _build(extra_flags)
    try:
        return NativeKernels(ctypes.CDLL(str(path)), path)
    except OSError as err:
        raise NativeBuildError(
            f"native kernels: cannot load {path.name}: {err}; delete it to rebuild, or set generator.kernels = 'torch'"
        ) from err


def _flags() -> list[str]:
    openmp = "OpenMP" in torch.__config__.parallel_info().split("ATen parallel backend:")[-1].splitlines()[0]
    return FLAGS + (["-fopenmp"] if openmp else []) + ["-lm"]


def _build(extra_flags: tuple[str, ...] = ()) -> Path:
    compiler = os.environ.get("CC", "cc")
    flags = _flags() + list(extra_flags)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NativeBuildError(
            f"native kernels: no C compiler ({compiler!r}: {err}); install one (apt-get install gcc) "
            "or set generator.kernels = 'torch'"
        ) from err
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_identity().encode()]))
    directory = _cache_dir()
    path = directory / f"gapless-decode-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, str(SOURCE), "-o", tmp, *flags], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise NativeBuildError(
                f"native kernels: {compiler} failed ({proc.stderr.strip()[-400:]}); "
                "set generator.kernels = 'torch' to run without them"
            )
        os.replace(tmp, path)  # atomic: processes building at once each publish a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gapless" / "kernels"
    for directory in (
        Path(os.environ.get("GAPLESS_KERNEL_CACHE", default)),
        Path(tempfile.gettempdir()) / f"gapless-kernels-{os.getuid()}",
    ):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if os.access(directory, os.W_OK):
                return directory
        except OSError:
            continue
    raise NativeBuildError("native kernels: no writable cache directory; set GAPLESS_KERNEL_CACHE to one")


def _cpu_identity() -> str:
    """What -march=native depends on: a library built for one CPU may not run on another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor() or platform.machine()
