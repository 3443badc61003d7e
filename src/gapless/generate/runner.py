"""A lean forward pass over a Hugging Face decoder's weights, with a slot KV cache.

`DecoderRunner` copies the model's weights into its own tensors once (q/k/v fused into one
matrix, gate/up into another, so a layer is three matmuls plus attention) and runs the same
arithmetic as the HF modules: RMSNorm in fp32, rotary embeddings from the model's own
`rotary_emb` (so every static RoPE variant matches), grouped-query attention with scale
head_dim**-0.5, SiLU-gated MLP, final norm and LM head. It never calls the HF module at run
time, which is where `generate`'s per-step overhead lives. The families it implements and their
variants (q/k norms, norms after the blocks, sliding windows, fused HF weights) are read from
the config by `families.layout_of`; any other model is refused here and served by the generic
path (`hf_runner.py`).

Two entry points: `prefill` runs right-padded contexts at positions 0..P-1 with a causal mask
(or only their tails, after keys/values a prefix cache holds) and returns their keys/values for
the engine to place; `decode` feeds one token for each of
the B running slots at its own position, writes its key/value into the cache, attends to
positions <= its own and returns the logits of the next token.
`load_state` takes a full HF state dict by name and copies it into the fused tensors in place;
the cache is untouched, so in-flight sequences survive a weight swap.
With the native kernels (`native.py`, fp32 on CPU) a decode layer is six native calls: RMSNorm,
the qkv matmul, RoPE + cache write + attention, the o matmul with the residual, RMSNorm, the
gate | up matmul with silu(gate) * up in its epilogue, the down matmul with the residual; the
matmuls (prefill's too) are the native `linear` kernel on weights in its panel layout.
Otherwise the same arithmetic runs as torch ops (the torch path), equal within fp32 rounding.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import numpy as np
import torch
import torch.nn.functional as F

from gapless.generate.families import LEAN_FAMILIES, Layout, layout_of
from gapless.generate.kv_cache import KVCache
from gapless.generate.native import NativeKernels, kernels_for
from gapless.models import FP32Head

SUPPORTED_MODEL_TYPES = LEAN_FAMILIES


@functools.cache
def keep_freed_memory() -> None:
    """Stop glibc from returning freed memory to the OS (process-wide, once).

    A decode step allocates and frees a few MB of activations; by default glibc unmaps large
    blocks on free and trims the heap top, so the next step page-faults the same memory back in.
    Measured on this project's CPU: three small ops right after a matmul took 120 us instead of
    17 us, 45 us with fixed thresholds. The cost is that the process keeps its peak heap size."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameter ids from <malloc.h>
    libc.mallopt(m_trim_threshold, 1 << 30)
    libc.mallopt(m_mmap_threshold, 1 << 25)  # glibc's maximum, 32 MB: larger blocks are still mapped on demand


def _onednn_available(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class _Linear:
    """y = (x * input_scale) @ weight.T + bias, where `input_scale` is the RMSNorm weight that
    precedes the matmul (or None). `weight`/`bias` are what the state dict fills. On CPU the
    matmul runs on a oneDNN-packed copy with the norm weight folded in, made at the first call
    after every load (so a runner built from a model that is then dropped never holds the model,
    its own copy and the packed copy at once): on this project's CPUs 1.5-2x faster than the BLAS
    path at decode batch sizes, and one elementwise op fewer; equal within fp32 rounding. With the
    native kernels (`native`) the packed copy is their panel layout instead, and the matmul theirs
    (on this CPU about as fast as oneDNN or up to 1.9x faster from 1 to 496 rows, docs/engine.md)."""

    def __init__(
        self,
        out_dim: int,
        in_dim: int,
        bias: bool,
        input_scale: torch.Tensor | None = None,
        native: NativeKernels | None = None,
        **like,
    ):
        self.weight = torch.empty(out_dim, in_dim, **like)
        self.bias = torch.empty(out_dim, **like) if bias else None
        self.input_scale = input_scale
        self.native = native  # set: the native kernel's panel layout instead of oneDNN's
        self.packed: torch.Tensor | None = None
        self.is_stale = True  # weights changed since the last pack

    def _folded(self) -> torch.Tensor:
        return self.weight if self.input_scale is None else self.weight * self.input_scale

    def pack(self) -> None:
        self.is_stale = False
        if self.native is not None:
            self.packed = self.native.pack_linear(self._folded())
        elif _onednn_available(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self._folded(), None)

    def invalidate(self) -> None:
        self.packed, self.is_stale = None, True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_stale:
            self.pack()
        if self.native is not None:
            return self.native.linear(x, self.packed, self.weight.shape[0], self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x if self.input_scale is None else x * self.input_scale, self.weight, self.bias)

    def residual(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x + a @ weight.T (+ bias) in one fused call (no input scale here)."""
        if self.is_stale:
            self.pack()
        if self.native is not None:
            return self.native.linear(a, self.packed, self.weight.shape[0], self.bias, residual=x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(a, x, self.packed, self.bias, "add")
        if self.bias is None and x.dim() == 2:
            return torch.addmm(x, a, self.weight.t())
        return x + F.linear(a, self.weight, self.bias)


class _GatedLinear(_Linear):
    """silu(x @ gate.T) * (x @ up.T) over one weight holding the rows gate | up (the HF gate_proj
    and up_proj). With the native kernels: one `linear` call over panels that interleave 8 gate and
    8 up columns, the activation and the product computed in its epilogue (no (B, 2 * mlp_dim)
    intermediate, no second pass). Otherwise, on CPU, the two halves are packed separately and the activation and the product
    run inside the matmuls as oneDNN post-ops: no (B, 2 * mlp_dim) intermediate, two elementwise
    passes fewer (measured 7-17% faster than matmul + chunk + silu + mul at batch 64-128)."""

    def pack(self) -> None:
        self.is_stale = False
        if self.native is not None:
            self.packed = self.native.pack_linear(self._folded(), gated=True)
            return
        if _onednn_available(self.weight):
            gate, up = self._folded().chunk(2)
            self.packed = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None) for w in (gate, up)]
            self.gate_up_bias = (None, None) if self.bias is None else tuple(self.bias.chunk(2))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_stale:
            self.pack()
        if self.native is not None:
            return self.native.linear(x, self.packed, self.weight.shape[0] // 2, self.bias, gated=True)
        if self.packed is not None:
            (gate, up), (gate_bias, up_bias) = self.packed, self.gate_up_bias
            activated = torch.ops.mkldnn._linear_pointwise(x, gate, gate_bias, "swish", [], "")  # silu(x @ gate.T)
            return torch.ops.mkldnn._linear_pointwise.binary(x, activated, up, up_bias, "mul")  # (x @ up.T) * activated
        gate, up = super().__call__(x).chunk(2, dim=-1)
        return F.silu(gate) * up


class _Layer:
    """One decoder block's weights, laid out for the fused matmuls. Pre-norm families fold the
    norm before attention into `qkv` and the one before the MLP into `gate_up`; olmo2 instead
    normalises each block's output (`attn_out_norm`, `mlp_out_norm`) before the residual add."""

    def __init__(
        self,
        dim: int,
        q_dim: int,
        kv_dim: int,
        mlp_dim: int,
        head_dim: int,
        biases: dict[str, bool],
        layout: Layout,
        window: int | None,
        native: NativeKernels | None,
        **like,
    ):
        pre = not layout.post_norms
        self.input_norm = torch.empty(dim, **like) if pre else None
        self.qkv = _Linear(q_dim + 2 * kv_dim, dim, biases["qkv"], self.input_norm, native, **like)  # rows: q | k | v
        norm_dims = {"none": None, "head": (head_dim, head_dim), "full": (q_dim, kv_dim)}[layout.qk_norm]
        self.q_norm, self.k_norm = (
            (None, None)
            if norm_dims is None
            else (torch.empty(norm_dims[0], **like), torch.empty(norm_dims[1], **like))
        )
        self.o = _Linear(dim, q_dim, biases["o"], None, native, **like)
        self.mlp_norm = torch.empty(dim, **like) if pre else None
        self.gate_up = _GatedLinear(2 * mlp_dim, dim, biases["mlp"], self.mlp_norm, native, **like)  # rows: gate | up
        self.down = _Linear(dim, mlp_dim, biases["mlp"], None, native, **like)
        self.attn_out_norm = None if pre else torch.empty(dim, **like)
        self.mlp_out_norm = None if pre else torch.empty(dim, **like)
        self.window = window  # sliding-window width in tokens, None = full attention

    def linears(self) -> list[_Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]


class DecoderRunner:
    pads_rows = True  # decode may run extra slots at position 0 (see engine.decode_rows)

    def __init__(self, model: torch.nn.Module, max_seq_len: int, kernels: str = "auto"):
        cfg = model.config
        keep_freed_memory()
        layout, why = layout_of(cfg)
        if layout is None:
            raise NotImplementedError(f"lean runner: {why}; the engine serves this model on its generic path")
        self.layout = layout
        weight = model.get_input_embeddings().weight
        self.dtype, self.device = weight.dtype, weight.device
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.num_heads // self.kv_heads
        self.eps = cfg.rms_norm_eps
        self.max_seq_len = max_seq_len
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        dim, q_dim, kv_dim, mlp_dim = (
            cfg.hidden_size,
            self.num_heads * self.head_dim,
            self.kv_heads * self.head_dim,
            cfg.intermediate_size,
        )
        names = set(model.state_dict())
        first = "model.layers.0."
        biases = {
            "qkv": any(first + f"self_attn.{m}.bias" in names for m in ("q_proj", "qkv_proj")),
            "o": first + "self_attn.o_proj.bias" in names,
            "mlp": first + "mlp.down_proj.bias" in names,
        }
        like = dict(dtype=self.dtype, device=self.device)
        self.native = kernels_for(kernels, self.dtype, self.device)  # None: the torch path
        # a window at least as long as every context is full attention
        windows = [w if w is not None and w < max_seq_len else None for w in layout.windows]
        self.layers = [
            _Layer(dim, q_dim, kv_dim, mlp_dim, self.head_dim, biases, layout, windows[i], self.native, **like)
            for i in range(self.num_layers)
        ]
        self.embed = torch.empty(cfg.vocab_size, dim, **like)
        self.final_norm = torch.empty(dim, **like)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.fp32_head = isinstance(model.get_output_embeddings(), FP32Head)  # model.fp32_lm_head
        self.lm_head = _Linear(cfg.vocab_size, dim, False, self.final_norm, self.native, **like)
        if self.tied:
            self.lm_head.weight = self.embed
        self._targets = self._name_map(q_dim, kv_dim, mlp_dim)
        self.load_state(model.state_dict())
        self.cos, self.sin_signed = self._rope_tables(model, max_seq_len)
        self.num_params = sum(p.numel() for p in model.parameters())

    def _name_map(self, q_dim: int, kv_dim: int, mlp_dim: int) -> dict[str, torch.Tensor]:
        """HF state-dict name -> the view of our tensors it fills."""
        targets = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.final_norm,
            "lm_head.weight": self.lm_head.weight,
        }
        q, k, v = slice(0, q_dim), slice(q_dim, q_dim + kv_dim), slice(q_dim + kv_dim, q_dim + 2 * kv_dim)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            parts: dict[str, torch.Tensor | None] = {
                "self_attn.o_proj.weight": layer.o.weight,
                "self_attn.o_proj.bias": layer.o.bias,
                "mlp.down_proj.weight": layer.down.weight,
                "mlp.down_proj.bias": layer.down.bias,
                "self_attn.q_norm.weight": layer.q_norm,
                "self_attn.k_norm.weight": layer.k_norm,
            }
            if self.layout.fused_names:  # phi3: the HF weights are already stacked as ours
                parts |= {
                    "self_attn.qkv_proj.weight": layer.qkv.weight,
                    "self_attn.qkv_proj.bias": layer.qkv.bias,
                    "mlp.gate_up_proj.weight": layer.gate_up.weight,
                    "mlp.gate_up_proj.bias": layer.gate_up.bias,
                }
            else:
                for name, rows in (("q", q), ("k", k), ("v", v)):
                    parts[f"self_attn.{name}_proj.weight"] = layer.qkv.weight[rows]
                    parts[f"self_attn.{name}_proj.bias"] = None if layer.qkv.bias is None else layer.qkv.bias[rows]
                gate_up_bias = layer.gate_up.bias
                parts |= {
                    "mlp.gate_proj.weight": layer.gate_up.weight[:mlp_dim],
                    "mlp.up_proj.weight": layer.gate_up.weight[mlp_dim:],
                    "mlp.gate_proj.bias": None if gate_up_bias is None else gate_up_bias[:mlp_dim],
                    "mlp.up_proj.bias": None if gate_up_bias is None else gate_up_bias[mlp_dim:],
                }
            if self.layout.post_norms:  # olmo2's names: post_attention_layernorm normalises the attention output
                parts |= {
                    "post_attention_layernorm.weight": layer.attn_out_norm,
                    "post_feedforward_layernorm.weight": layer.mlp_out_norm,
                }
            else:
                parts |= {"input_layernorm.weight": layer.input_norm, "post_attention_layernorm.weight": layer.mlp_norm}
            targets |= {p + name: t for name, t in parts.items() if t is not None}
        return targets

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor], partial: bool = False) -> None:
        """Copy weights in place by HF name. Every weight must be present (a tied LM head may be
        omitted): a partial push would silently mix two policies. `partial`: only the weights
        that change (a LoRA merge, generate/adapters.py: the others are the frozen base)."""
        unknown = set(state) - set(self._targets)
        missing = set() if partial else set(self._targets) - set(state) - ({"lm_head.weight"} if self.tied else set())
        if unknown or missing:
            raise KeyError(
                f"weights do not match the engine's model: unknown {sorted(unknown)[:5]}, missing {sorted(missing)[:5]}"
            )
        for name, tensor in state.items():
            self._targets[name].copy_(tensor)
        for linear in [self.lm_head] + [lin for layer in self.layers for lin in layer.linears()]:
            linear.invalidate()  # the old packed copy is freed now, the new one made at first use

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's current weights under their HF names (views, not copies)."""
        return dict(self._targets)

    def _rope_tables(self, model: torch.nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=self.device)[None]
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(self.embed[:1][None], positions)  # (1, L, head_dim)
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: same products, one op fewer
        sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return cos[0].to(self.dtype).contiguous(), sin_signed.to(self.dtype).contiguous()  # (L, head_dim)

    def new_cache(self, slots: int) -> KVCache:
        return KVCache(self.num_layers, slots, self.kv_heads, self.max_seq_len, self.head_dim, self.dtype, self.device)

    def place(
        self, cache: KVCache, kv: list[tuple[torch.Tensor, torch.Tensor]], rows: list[int], slots: list[int]
    ) -> None:
        """Write prefill row `rows[i]` into slot `slots[i]` of every layer's cache."""
        rows_t, slots_t = torch.tensor(rows), torch.tensor(slots)
        for layer, (k, v) in enumerate(kv):
            cache.write_prefix(layer, k, v, rows_t, slots_t)

    def stash_row(
        self, kv: list[tuple[torch.Tensor, torch.Tensor]], row: int, length: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one prefill row's first `length` positions, placeable later as row 0."""
        return [(k[row : row + 1, :, :length].clone(), v[row : row + 1, :, :length].clone()) for k, v in kv]

    def stash_slot(self, cache: KVCache, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one cache slot's first `length` positions, placeable later as row 0."""
        return [
            (k[slot : slot + 1, :, :length].clone(), v[slot : slot + 1, :, :length].clone())
            for k, v in zip(cache.keys, cache.values)
        ]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight (the next `_Linear` applies it), in fp32 like HF."""
        if self.native is not None and x.is_contiguous():
            return self.native.rms_norm(x, self.eps)
        return F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)  # no copies when x is fp32

    def _weighted_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), x.shape[-1:], weight.float(), self.eps).to(x.dtype)

    def _qk_norm(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """(T, (H + 2 KV) * hd) -> the same with queries and keys RMS-normalised (qwen3: each
        head over head_dim, in place with the native kernels; olmo2: all heads together), as a
        contiguous tensor."""
        if layer.q_norm is None:
            return qkv
        if self.native is not None and self.layout.qk_norm == "head" and qkv.is_contiguous():
            return self.native.head_norm(qkv, layer.q_norm, layer.k_norm, self.num_heads, self.kv_heads, self.eps)
        rows, q_dim, kv_dim = qkv.shape[0], self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]
        if self.layout.qk_norm == "head":
            q = self._weighted_norm(q.reshape(rows, self.num_heads, self.head_dim), layer.q_norm).view(rows, q_dim)
            k = self._weighted_norm(k.reshape(rows, self.kv_heads, self.head_dim), layer.k_norm).view(rows, kv_dim)
        else:
            q, k = self._weighted_norm(q, layer.q_norm), self._weighted_norm(k, layer.k_norm)
        return torch.cat([q, k, v], dim=-1)

    def _project_qkv(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        return self._qk_norm(layer.qkv(x if layer.input_norm is None else self._norm(x)), layer)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * cos, torch.roll(x, self.head_dim // 2, dims=-1), sin_signed)

    def _attention_residual(self, x: torch.Tensor, att: torch.Tensor, layer: _Layer) -> torch.Tensor:
        if layer.attn_out_norm is not None:
            return x + self._weighted_norm(layer.o(att), layer.attn_out_norm)
        return layer.o.residual(x, att)

    def _mlp_residual(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        if layer.mlp_out_norm is not None:
            return x + self._weighted_norm(layer.down(layer.gate_up(x)), layer.mlp_out_norm)
        h = self._norm(x)
        return layer.down.residual(x, layer.gate_up(h))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_head:  # as models.FP32Head: the head's matmul in float32 whatever the weights' dtype
            return F.linear(self._norm(x).float() * self.final_norm.float(), self.lm_head.weight.float())
        return self.lm_head(self._norm(x))

    @torch.no_grad()
    def prefill(
        self, rows: list[tuple[int, ...]], past: list[list[tuple[torch.Tensor, torch.Tensor]] | None] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of token rows of any lengths, each at positions 0..n-1: per layer
        (R, kv_heads, P, head_dim) with P the longest row; past a row's length they are zero,
        which the decode mask hides. The matmuls see only real tokens (rows packed end to end);
        attention runs on the right-padded layout, where causality alone keeps rows apart.
        `past[i]` (optional): keys/values already computed for row i's first m tokens (per layer
        (1, kv_heads, m, head_dim), a prefix cache hit with m < len(row)); only the rest of the row
        is run, attending to them, and they are copied into the returned rows as they are.
        No logits: the engine samples every token in `decode`."""
        starts = [0 if p is None else p[0][0].shape[2] for p in past or [None] * len(rows)]
        lengths = [len(r) for r in rows]
        width, count, first = max(lengths), len(rows), min(starts)  # queries start at `first`
        span = width - first  # query positions first..width-1
        tokens = torch.tensor([t for r, s in zip(rows, starts) for t in r[s:]], device=self.device)  # (T,)
        positions = torch.cat([torch.arange(s, n, device=self.device) for s, n in zip(starts, lengths)])  # (T,)
        padded = torch.cat(
            [torch.arange(s, n, device=self.device) + i * width for i, (s, n) in enumerate(zip(starts, lengths))]
        )  # (T,) into R * P
        queries = padded - torch.repeat_interleave(
            torch.arange(count, device=self.device) * first + first,
            torch.tensor([n - s for s, n in zip(starts, lengths)]),
        )  # (T,) into R * span
        cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # (T, 1, hd)
        at = torch.arange(width, device=self.device)
        seen = at[None] <= at[first:, None]  # (span, P): causal
        masks = {
            w: seen if w is None else seen & (at[None] > at[first:, None] - w)  # and within the window
            for w in {layer.window for layer in self.layers}
            if first > 0 or (w is not None and w < width)
        }  # none needed: full attention from position 0 is SDPA's is_causal

        def pad(
            t: torch.Tensor, at_rows: torch.Tensor, length: int
        ) -> torch.Tensor:  # (T, heads, hd) -> (R, heads, length, hd)
            out = t.new_zeros(count * length, t.shape[1], self.head_dim).index_copy_(0, at_rows, t)
            return out.view(count, length, t.shape[1], self.head_dim).transpose(1, 2)

        x = F.embedding(tokens, self.embed)  # (T, D)
        kv = []
        for i, layer in enumerate(self.layers):
            qkv = self._project_qkv(x, layer).view(len(tokens), self.num_heads + 2 * self.kv_heads, self.head_dim)
            k = self._rope(qkv[:, self.num_heads : self.num_heads + self.kv_heads], cos, sin)
            keys, values = pad(k, padded, width), pad(qkv[:, self.num_heads + self.kv_heads :], padded, width)
            for r, cached in enumerate(past or []):
                if cached is not None:
                    keys[r, :, : starts[r]], values[r, :, : starts[r]] = cached[i][0][0], cached[i][1][0]
            kv.append((keys, values))
            if i == self.num_layers - 1:
                break  # the last layer's output feeds only logits, which prefill does not produce
            q = pad(self._rope(qkv[:, : self.num_heads], cos, sin), queries, span)
            mask = masks.get(layer.window)
            att = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=self.group > 1
            )  # (R, H, span, hd)
            att = att.transpose(1, 2).reshape(count * span, -1).index_select(0, queries)  # (T, H * hd)
            x = self._mlp_residual(self._attention_residual(x, att, layer), layer)
        return kv

    @torch.no_grad()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, ranges: list[tuple[int, int]] | None = None
    ) -> torch.Tensor:
        """One token for each of the slots 0..B-1 at `positions` (B,); returns logits (B, V).
        `ranges`: contiguous slot ranges covering 0..B-1 that attend separately, each over its
        own longest length (default: `attention_ranges(positions)`); the native kernels ignore it,
        since each slot reads exactly its own length there."""
        if self.native is not None:
            return self._decode_native(tokens, positions, cache)
        cache.hold(int(positions.max()) + 1)
        batch, heads, kv_heads, hd = tokens.shape[0], self.num_heads, self.kv_heads, self.head_dim
        lengths = positions.tolist()
        ranges = ranges if ranges is not None else attention_ranges(lengths)
        spans = [max(lengths[lo:hi]) + 1 for lo, hi in ranges]
        masks = {
            w: [
                self._mask(positions[lo:hi], span, w) for (lo, hi), span in zip(ranges, spans)
            ]  # (rows * KV, group, span)
            for w in {layer.window for layer in self.layers}
        }
        x = F.embedding(tokens, self.embed)  # (B, D)
        cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # (B, 1, hd)
        # cache index of (slot b, kv head h, position of b), broadcast to (B, KV)
        at = (
            torch.arange(batch, device=self.device)[:, None],
            torch.arange(kv_heads, device=self.device)[None],
            positions[:, None],
        )
        for i, layer in enumerate(self.layers):
            qkv = self._project_qkv(x, layer).view(batch, heads + 2 * kv_heads, hd)
            qk = self._rope(qkv[:, : heads + kv_heads], cos, sin)  # (B, H + KV, hd)
            keys, values = cache.keys[i], cache.values[i]
            keys[at] = qk[:, heads:]  # (B, KV, hd)
            values[at] = qkv[:, heads + kv_heads :]
            # the `group` query heads sharing a KV head are the query rows of one small attention
            q = qk[:, :heads].reshape(batch, kv_heads, self.group, hd)
            parts = [
                self._attend(q[lo:hi], keys[lo:hi, :, :span], values[lo:hi, :, :span], mask)  # views, no copy
                for (lo, hi), span, mask in zip(ranges, spans, masks[layer.window])
            ]
            att = parts[0] if len(parts) == 1 else torch.cat(parts)  # (B, KV, group, hd)
            x = self._attention_residual(x, att.view(batch, heads * hd), layer)
            x = self._mlp_residual(x, layer)
        return self._logits(x)

    def _decode_native(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """`decode` with one native call per layer for RoPE, the cache write and attention."""
        # the kernel writes where positions point: check them, as an index op would
        limit = min(cache.max_seq_len, self.cos.shape[0])
        positions = positions.to(torch.int64).contiguous()
        if tokens.shape[0] > cache.slots or int(positions.min()) < 0 or int(positions.max()) >= limit:
            raise ValueError(
                f"decode: {tokens.shape[0]} rows at positions {int(positions.min())}..{int(positions.max())} "
                f"do not fit a cache of {cache.slots} slots x {limit} positions"
            )
        cache.hold(int(positions.max()) + 1)
        x = F.embedding(tokens, self.embed)  # (B, D)
        for i, layer in enumerate(self.layers):
            qkv = self._project_qkv(x, layer)  # (B, (H + 2 KV) * hd), contiguous
            att = self.native.decode_attend(
                qkv,
                self.cos,
                self.sin_signed,
                positions,
                cache.keys[i],
                cache.values[i],
                self.num_heads,
                self.kv_heads,
                self.head_dim**-0.5,
                layer.window or 0,
            )
            x = self._mlp_residual(self._attention_residual(x, att, layer), layer)
        return self._logits(x)

    def _mask(self, positions: torch.Tensor, span: int, window: int | None = None) -> torch.Tensor:
        """Additive mask (rows * KV, group, span): -inf on the positions a row has not written
        yet, and with a sliding window on those `window` or more tokens behind it."""
        at = torch.arange(span, device=self.device)[None]
        hidden = at > positions[:, None]  # (rows, span)
        if window is not None:
            hidden |= at <= positions[:, None] - window
        mask = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(hidden, float("-inf"))
        return mask[:, None, None].expand(-1, self.kv_heads, self.group, span).reshape(-1, self.group, span)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (R, KV, group, hd) against keys/values (R, KV, L, hd) -> (R, KV, group, hd)."""
        rows, hd = q.shape[0], self.head_dim
        scores = torch.baddbmm(
            mask, q.flatten(0, 1), keys.flatten(0, 1).transpose(1, 2), alpha=hd**-0.5
        )  # (R * KV, group, L)
        att = torch.bmm(torch.softmax(scores, dim=-1), values.flatten(0, 1))
        return att.view(rows, self.kv_heads, self.group, hd)


def attention_ranges(positions: list[int], overhead: int = 256) -> list[tuple[int, int]]:
    """Contiguous slot ranges [lo, hi) covering 0..B-1, each to attend over its own longest length.

    Decode attention is bound by reading keys/values, and one attention over the whole batch
    reads every row up to the longest row: with long sequences among short ones (a heavy-tailed
    batch) most of what it reads is masked out. Ranges of the slot order are views of the cache,
    so splitting copies nothing; the split minimises sum over ranges of (rows x (longest position
    + 1)) + `overhead` per range (the extra calls, in the same units: positions read per row),
    exactly, by dynamic programming over the cut points. Retirement fills holes from the last
    slots, which keeps sequences admitted together next to each other, so cohorts of similar
    length sit in contiguous ranges. All positions advance by one per step, adding B to every
    partition's cost alike: the best split changes only when the batch does."""
    lengths = np.asarray(positions, dtype=np.int64) + 1
    batch = len(lengths)
    best = np.zeros(batch + 1, dtype=np.int64)  # best[i]: cheapest split of rows 0..i-1
    cut = np.zeros(batch + 1, dtype=np.int64)  # where the last range of that split starts
    for i in range(1, batch + 1):
        longest = np.maximum.accumulate(lengths[i - 1 :: -1])  # longest[k]: of rows i-1-k .. i-1
        cost = best[i - 1 :: -1] + np.arange(1, i + 1) * longest + overhead  # last range = rows i-1-k .. i-1
        k = int(cost.argmin())
        best[i], cut[i] = cost[k], i - 1 - k
    ranges, hi = [], batch
    while hi > 0:
        ranges.append((int(cut[hi]), hi))
        hi = int(cut[hi])
    return ranges[::-1]
