"""The native decode kernels against plain torch formulas, and how they are built and chosen."""

import logging

import pytest
import torch
import torch.nn.functional as F

from gapless.generate import native
from gapless.generate.native import NativeBuildError, kernels_for


@pytest.fixture(scope="module")
def kernels():
    return native.load()


def _rope(x, cos, sin):  # HF's form: x * cos + rotate_half(x) * sin
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _reference(qkv, cos, sin, positions, keys, values, heads, kv_heads):
    """Attention of each slot over its positions 0..p after writing its new key/value at p."""
    hd = keys.shape[-1]
    qkv = qkv.view(len(positions), heads + 2 * kv_heads, hd)
    out = torch.empty(len(positions), heads, hd)
    for b, p in enumerate(positions.tolist()):
        keys[b, :, p] = _rope(qkv[b, heads : heads + kv_heads], cos[p], sin[p])
        values[b, :, p] = qkv[b, heads + kv_heads :]
        q = _rope(qkv[b, :heads], cos[p], sin[p]).view(kv_heads, heads // kv_heads, hd)
        scores = q @ keys[b, :, : p + 1].transpose(1, 2) * hd**-0.5  # (KV, group, p + 1)
        out[b] = (torch.softmax(scores, -1) @ values[b, :, : p + 1]).reshape(heads, hd)
    return out.view(len(positions), heads * hd)


@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(4, 4, 8), (4, 2, 64), (8, 2, 16), (6, 1, 32)])
def test_decode_attention_equals_the_torch_formula(kernels, heads, kv_heads, hd):
    """GQA groups 1-6, heavy-tailed positions, a spare slot: same output and the same cache,
    every position except each row's new one untouched."""
    gen = torch.Generator().manual_seed(heads * hd)
    max_len, positions = 300, torch.tensor([0, 5, 299, 17, 1, 120, 3])
    batch = len(positions)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * hd, generator=gen)
    angles = torch.rand(max_len, hd // 2, generator=gen) * torch.arange(max_len)[:, None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    sin_signed = torch.cat([-sin[:, : hd // 2], sin[:, hd // 2 :]], -1)
    keys, values = (torch.randn(batch + 1, kv_heads, max_len, hd, generator=gen) for _ in range(2))
    ref_keys, ref_values = keys.clone(), values.clone()
    got = kernels.decode_attend(qkv, cos, sin_signed, positions, keys, values, heads, kv_heads, hd**-0.5)
    want = _reference(qkv, cos, sin, positions, ref_keys, ref_values, heads, kv_heads)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.allclose(keys, ref_keys, atol=1e-6) and torch.equal(values, ref_values)


@pytest.mark.parametrize("rows", [1, 64, 600])  # 600 x 256 runs the parallel branch
def test_rms_norm_equals_torch(kernels, rows):
    x = torch.randn(rows, 256) * 3
    assert torch.allclose(kernels.rms_norm(x, 1e-6), F.rms_norm(x, (256,), None, 1e-6), atol=1e-6)


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 48), (7, 100, 37), (16, 896, 160), (53, 1100, 16), (130, 33, 5)])
def test_linear_equals_the_torch_matmul(kernels, rows, k, n):
    """Row counts past one tile (6) and one chunk (48), K past one block (512), N not a multiple of
    the 16-column panel: x @ W.T, + bias, + residual, as F.linear within fp32 rounding."""
    gen = torch.Generator().manual_seed(rows * k + n)
    x, weight, bias, residual = (torch.randn(*shape, generator=gen) for shape in ((rows, k), (n, k), (n,), (rows, n)))
    packed = kernels.pack_linear(weight)
    assert packed.shape == (-(-n // 16), k, 16)
    tol = 1e-5 * k**0.5
    assert torch.allclose(kernels.linear(x, packed, n), F.linear(x, weight), atol=tol)
    assert torch.allclose(kernels.linear(x, packed, n, bias, residual), residual + F.linear(x, weight, bias), atol=tol)


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 8), (16, 600, 44), (50, 96, 13)])
def test_gated_linear_equals_silu_gate_times_up(kernels, rows, k, n):
    """gate | up stacked, n not a multiple of the 8 gate columns per panel, with and without bias."""
    gen = torch.Generator().manual_seed(rows + k + n)
    x, weight, bias = (
        torch.randn(rows, k, generator=gen),
        torch.randn(2 * n, k, generator=gen),
        torch.randn(2 * n, generator=gen),
    )
    packed = kernels.pack_linear(weight, gated=True)
    for b in (None, bias):
        gate, up = F.linear(x, weight, b).chunk(2, dim=-1)
        got = kernels.linear(x, packed, n, b, gated=True)
        assert torch.allclose(got, F.silu(gate) * up, atol=1e-4 * k**0.5), (got - F.silu(gate) * up).abs().max()


def test_linear_rows_do_not_depend_on_their_batch_or_threads(kernels):
    """A row's output is bitwise the same alone, in any batch and at any thread count: the sum
    over k runs in one order whatever the tiling."""
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(37, 700, generator=gen), torch.randn(90, 700, generator=gen)
    packed, threads = kernels.pack_linear(weight), torch.get_num_threads()
    full = kernels.linear(x, packed, 90)
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.linear(x, packed, 90), full)
        for row in (0, 5, 36):
            assert torch.equal(kernels.linear(x[row : row + 1], packed, 90)[0], full[row])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="does not match"):
        kernels.linear(x[:, :-1], packed, 90)


def test_linear_bits_do_not_depend_on_the_tile_shape(kernels):
    """The AVX-512 build (8 x 32 tiles) and an AVX2 build of the same source (6 x 16 tiles, forced
    with -mno-avx512f) give the same bits, plain and gated, odd and even panel counts: a library
    built for another CPU computes the same log-probs. On a CPU without AVX-512 both builds are the
    AVX2 one."""
    try:
        avx2 = native.load(("-mno-avx512f",))
    except NativeBuildError as err:  # a compiler that rejects the flag (not GCC or Clang on x86)
        pytest.skip(str(err))
    gen = torch.Generator().manual_seed(11)
    for rows, k, n in ((16, 896, 48), (9, 1030, 160), (1, 64, 16), (53, 300, 37)):
        x, weight, bias = (
            torch.randn(rows, k, generator=gen),
            torch.randn(2 * n, k, generator=gen),
            torch.randn(2 * n, generator=gen),
        )
        packed, gated = kernels.pack_linear(weight[:n]), kernels.pack_linear(weight, gated=True)
        assert torch.equal(kernels.linear(x, packed, n, bias[:n]), avx2.linear(x, packed, n, bias[:n]))
        assert torch.equal(kernels.linear(x, gated, n, bias, gated=True), avx2.linear(x, gated, n, bias, gated=True))


def test_head_norm_equals_per_head_rms_norm(kernels):
    """qwen3's q/k norms: every query and key head normalised with its weight, values untouched."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, hd, rows = 6, 2, 32, 300  # 300 x 8 heads x 32 runs the parallel branch
    qkv, q_w, k_w = (
        torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=gen) * 3,
        torch.rand(hd, generator=gen),
        torch.rand(hd, generator=gen),
    )
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    want = torch.cat(
        [
            F.rms_norm(q.reshape(rows, heads, hd), (hd,), q_w, 1e-6).reshape(rows, -1),
            F.rms_norm(k.reshape(rows, kv_heads, hd), (hd,), k_w, 1e-6).reshape(rows, -1),
            v,
        ],
        dim=-1,
    )
    got = kernels.head_norm(qkv.clone(), q_w, k_w, heads, kv_heads, 1e-6)
    assert torch.allclose(got, want, atol=1e-5) and torch.equal(got[:, -kv_heads * hd :], v)


def test_decode_attention_rejects_mismatched_shapes(kernels):
    keys = torch.zeros(2, 2, 16, 8)
    with pytest.raises(ValueError, match="do not match 4 heads"):
        kernels.decode_attend(
            torch.zeros(2, 7 * 8),
            torch.zeros(16, 8),
            torch.zeros(16, 8),
            torch.zeros(2, dtype=torch.long),
            keys,
            keys.clone(),
            4,
            2,
            1.0,
        )


def test_build_is_cached_per_source_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("GAPLESS_KERNEL_CACHE", str(tmp_path))
    first = native._build()
    mtime = first.stat().st_mtime_ns
    assert native._build() == first and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind


def test_a_failing_compiler_falls_back_in_auto_and_raises_in_native(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GAPLESS_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1 for any input
    with pytest.raises(NativeBuildError, match="set generator.kernels = 'torch'"):
        native._build()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(native, "load", native._build)  # bypass the per-process cache of the real library
    with caplog.at_level(logging.WARNING, logger="gapless.generate.native"):
        assert kernels_for("auto", torch.float32, torch.device("cpu")) is None
    assert "torch path" in caplog.text
    with pytest.raises(NativeBuildError):
        kernels_for("native", torch.float32, torch.device("cpu"))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(NativeBuildError, match="no C compiler"):
        native._build()


def test_native_mode_refuses_what_it_cannot_run():
    assert kernels_for("torch", torch.float32, torch.device("cpu")) is None
    assert kernels_for("auto", torch.bfloat16, torch.device("cpu")) is None
    with pytest.raises(NativeBuildError, match="fp32 on CPU only"):
        kernels_for("native", torch.bfloat16, torch.device("cpu"))


def test_decode_refuses_positions_outside_the_cache(problems):
    """The kernel writes keys/values where the positions point: the runner checks them first."""
    from gapless.config import ModelConfig
    from gapless.generate.runner import DecoderRunner
    from gapless.models import build_tiny

    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)
    runner = DecoderRunner(build_tiny(cfg, [p.prompt for p in problems], seed=0).model, 32, "native")
    cache = runner.new_cache(2)
    assert runner.decode(torch.tensor([5, 6]), torch.tensor([0, 31]), cache).shape == (2, 300)
    for positions in ([0, 32], [-1, 0], [0, 0, 0]):  # past the end, negative, more rows than slots
        with pytest.raises(ValueError, match="do not fit a cache of 2 slots x 32 positions"):
            runner.decode(torch.ones(len(positions), dtype=torch.long), torch.tensor(positions), cache)


def test_sampling_equals_the_torch_sampler(kernels):
    """Per-row temperatures: the same tokens as the torch inverse-CDF sampler for random u (which
    never lands within float rounding of a CDF step here), log-probs equal to
    log_softmax(logits / T) at the token; u at the top of [0, 1) still lands on a real token."""
    from gapless.generate.sampling import RowSettings, sample_rows

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 300, 512
    logits = torch.randn(rows, vocab, generator=gen) * 4
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.3
    u = torch.rand(rows, generator=gen)
    settings = RowSettings(
        temperature,
        torch.ones(rows),
        torch.zeros(rows, dtype=torch.long),
        torch.zeros(rows, dtype=torch.bool),
        any_truncation=False,
        any_greedy=False,
        all_greedy=False,
    )
    want_tokens, _ = sample_rows(logits, settings, u)
    tokens, logprobs = kernels.sample_rows(logits, temperature, u)
    assert torch.equal(tokens, want_tokens)
    exact = torch.log_softmax(logits / temperature[:, None], -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, exact, atol=1e-5)

    last = torch.full((4, vocab), float("-inf"))
    last[:, 7] = 0.0  # one token holds all the mass (the others masked out)
    tokens, logprobs = kernels.sample_rows(last, torch.ones(4), torch.tensor([0.0, 0.5, 0.99999994, 1.0]))
    assert tokens.tolist() == [7, 7, 7, 7] and logprobs.abs().max() < 1e-5
