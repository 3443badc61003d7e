"""Base models and training runs of the Tinker service: the model work behind each SDK call.

    BaseModels           name -> Policy, loaded once from a local checkpoint directory (or built)
    TrainingRun          one training client: its own LoRA adapter on the base model's one shared
                         peft copy (or a whole private copy, for full fine-tuning), its gradients
                         and Adam state
      forward_backward   per-datum log-probs, the summed loss (tinker_losses), gradients accumulated
                         (datums sharing a prefix packed into prefix trees, each shared token run
                         once: service/prefix_tree.py; in micro-batches of at most
                         `micro_batch_tokens` tree nodes, rows x widest: the sums, and so the
                         gradients, are those of one datum at a time up to float rounding)
      optim_step         AdamW with the SDK's parameters on the accumulated gradients, then zero them
      save / load        adapter (or full weights) + optimizer state, one torch file per checkpoint
      sampler_state      full HF-named weights (adapter merged) for a sampling engine

LoRA runs on one base share its frozen weights (one copy, whatever the number of clients) and
nothing else: each call activates the run's own adapter first, so two clients never see each
other's adapters, gradients or optimizer state (lora.py's guarantee; tested). Every method runs on the service's one
training thread (service/app.py), which executes calls in arrival order.
Guaranteed: bad input (token ids outside the vocabulary, loss inputs whose shape differs from the
datum's, an unknown loss) raises `UserError` before any gradient changes; a run's log-probs are
those of the same weights the sampler gets from `sampler_state` (fp32 rounding apart).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken

from gapless.config import ConfigError
from gapless.config.sections import BaseModelEntry
from gapless.generate.families import require_engine
from gapless.lora import (
    LoraSpec,
    activate,
    adapter_parameters,
    adapter_state,
    add_lora,
    attach_lora,
    load_adapter_state,
    merged_state,
    remove_lora,
)
from gapless.models import Policy, load_local, load_tokenizer, save_tokenizer
from gapless.service.hub_cache import check_renderer, export_tokenizer, recommended_renderer
from gapless.service.losses import LossInputError, loss_fn
from gapless.service.prefix_tree import pack
from gapless.service.tree_attention import tree_inputs
from gapless.service.wire import DatumIn
from gapless.trainer.selected_logprobs import selected_logprobs


class UserError(ValueError):
    """A request the client must fix; becomes a failed future of category "user"."""


@dataclass
class BaseModel:
    name: str
    policy: Policy
    tokenizer_dir: str  # the tokenizer alone, saved by the service: the SDK's tokenizer_id
    context: int  # tokens of a datum, or of a sample's prompt plus max_tokens (check_context)
    renderer: str | None = None  # the tinker-cookbook renderer family of its chat format
    adapted: torch.nn.Module | None = None  # one peft model holding every LoRA run's adapter on this base
    adapters_made: int = 0

    @property
    def vocab_size(self) -> int:
        return int(self.policy.model.config.vocab_size)


def check_context(base: BaseModel, tokens: int, what: str, fix: str = "shorten it") -> None:
    """The one context rule of the service: forward, forward_backward and sample all refuse a
    sequence longer than the base model's context with this message (and capabilities report it)."""
    if tokens > base.context:
        raise UserError(
            f"{what} has {tokens} tokens, more than the {base.context}-token context of {base.name!r} "
            f"(max_context_length in get_server_capabilities): {fix}"
        )


class BaseModels:
    """The configured base models (`[service] base_models`: name -> entry); an entry without a
    path is a built-in model (`builtin` builds the embedded tiny model on first use, `builtins`
    the other kinds by their `BaseModelEntry.builtin` name), and no entry at all serves the tiny
    one as "gapless-tiny".

    Each base model's tokenizer is also saved alone under `tokenizer_root/NAME`, and that directory
    is what get_info reports as `tokenizer_id`: `AutoTokenizer.from_pretrained` (the SDK's
    `get_tokenizer()`, the cookbook's) on a full checkpoint would rebuild a plain `tokenizers`
    tokenizer as the model family's class and tokenize differently; on the tokenizer alone it
    loads exactly the tokenizer the service uses. With `export_tokenizers` it is also written into
    the Hugging Face cache under the served name (service/hub_cache.py)."""

    def __init__(
        self,
        entries: dict[str, BaseModelEntry | dict | str],
        builtin=None,
        builtins: dict | None = None,
        tokenizer_root: str | Path = "runs/service/tokenizers",
        max_seq_len: int = 4096,
        export_tokenizers: bool = False,
        log=print,
    ):
        self._entries = {k: _entry(v) for k, v in entries.items()}
        if not self._entries and builtin is not None:
            self._entries = {"gapless-tiny": BaseModelEntry()}
        self._builtins = {"tiny": builtin, **(builtins or {})}
        self._built: dict[str, Policy] = {}
        self._tokenizer_root, self.max_seq_len = Path(tokenizer_root), max_seq_len
        self._export, self._log = export_tokenizers, log
        self._loaded: dict[str, BaseModel] = {}

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> BaseModel:
        if name in self._loaded:
            return self._loaded[name]
        entry = self._entries.get(name)
        if entry is None or (entry.path is None and self._builtins.get(entry.builtin) is None):
            raise UserError(
                f"unknown base model {name!r}; this service serves {', '.join(self.names) or 'nothing'} "
                '(name more in the service config: [service] base_models = {NAME = "DIR"})'
            )
        field = f"service.base_models.{name!r}"
        if entry.path is not None:
            policy = load_local(entry.path)
            require_engine(policy.model)
            context = min(self.max_seq_len, policy.model.config.max_position_embeddings)
        else:
            policy = self._builtin_copy(entry.builtin)
            # rotary positions, no learned table: the config's bound is all that limits the context
            policy.model.config.max_position_embeddings = max(
                policy.model.config.max_position_embeddings, self.max_seq_len
            )
            untie_head(policy.model)
            add_think_tokens(policy)
            context = self.max_seq_len
        if entry.tokenizer is not None:
            policy = _with_tokenizer(policy, load_tokenizer(Path(entry.tokenizer)), f"{field}.tokenizer")
        renderer = entry.renderer or recommended_renderer(name)
        if renderer is not None and (why := check_renderer(renderer, policy.tokenizer)) is not None:
            raise ConfigError(
                f"{field}.renderer: the cookbook renderer {renderer!r} does not work with this model's tokenizer "
                f"({why}); name the renderer its chat format follows"
            )
        tokenizer_dir = (self._tokenizer_root / _SAFE.sub("_", name)).resolve()
        save_tokenizer(policy.tokenizer, tokenizer_dir)
        if self._export and (skipped := export_tokenizer(name, tokenizer_dir)) is not None:
            self._log(f"tokenizer of {name!r} not exported to the Hugging Face cache: {skipped}")
        policy.model.requires_grad_(False)
        model = self._loaded[name] = BaseModel(name, policy, str(tokenizer_dir), context, renderer)
        return model

    def _builtin_copy(self, kind: str) -> Policy:
        """A built-in model, built once; a second name serving it gets its own copy (LoRA
        adapters attach to a base model's module, which two names must not share)."""
        if kind not in self._built:
            self._built[kind] = self._builtins[kind]()
            return self._built[kind]
        return copy.deepcopy(self._built[kind])


def untie_head(model: torch.nn.Module) -> None:
    """Give a model whose LM head is its embedding matrix a head of its own, equal to it (the
    function is unchanged). A LoRA client's `train_unembed` then adapts the head: with the tied
    matrix frozen, the logits' range is bounded by the embeddings' norms, which in a small model
    (embeddings of tokens it never trained on stay near their initial scale) caps every token's
    probability at a few percent, and no LoRA on the layers below can teach a confident reply."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    text.tie_word_embeddings = False


THINK_TOKENS = ("<think>", "</think>")


def add_think_tokens(policy: Policy) -> None:
    """Give a built-in model's tokenizer Qwen3's `<think>` and `</think>` (one token each, decoded
    as text, as in Qwen3's own tokenizer), with new rows in the embedding and the head. The
    cookbook's Qwen3.5 renderers (the default of its `shorter` and `guess_number` recipes) need
    `</think>` to be one token. Each new row (embedding and head) is the mean of the old ones: the
    existing tokens' logits are unchanged, and a new token is about as likely as an average one."""
    tokenizer, model = policy.tokenizer, policy.model
    missing = [t for t in THINK_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if not missing:
        return
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in missing])
    old = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) <= old:
        return
    means = [m.weight.detach().mean(0) for m in (model.get_input_embeddings(), model.get_output_embeddings())]
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        for module, mean in zip((model.get_input_embeddings(), model.get_output_embeddings()), means):
            module.weight[old:] = mean


def _entry(value: BaseModelEntry | dict | str) -> BaseModelEntry:
    if isinstance(value, BaseModelEntry):
        return value
    return BaseModelEntry(path=value) if isinstance(value, str) else BaseModelEntry.model_validate(value)


def _with_tokenizer(policy: Policy, tokenizer, field: str) -> Policy:
    if len(tokenizer) > policy.model.config.vocab_size:
        raise ConfigError(
            f"{field}: the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary "
            f"({policy.model.config.vocab_size}); give the tokenizer this model was trained with"
        )
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else policy.eos_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return Policy(policy.model, tokenizer, eos, pad)


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping


class TrainingRun:
    def __init__(self, model_id: str, base: BaseModel, spec: LoraSpec | None, micro_batch_tokens: int = 4096):
        self.model_id, self.base, self.spec = model_id, base, spec
        self.micro_batch_tokens = micro_batch_tokens
        self.adapter = f"run{base.adapters_made}"  # a module-name-safe key (model ids hold ':')
        if spec is None:
            self.model = copy.deepcopy(base.policy.model).requires_grad_(True)
            self.params = list(self.model.parameters())
        else:
            if base.adapted is None:
                base.adapted = attach_lora(base.policy.model, spec, self.adapter)
            else:
                add_lora(base.adapted, spec, self.adapter)
            self.model = base.adapted
            self.params = adapter_parameters(self.model, self.adapter)
        base.adapters_made += 1
        self.optimizer: torch.optim.AdamW | None = None
        self.steps = 0

    @property
    def _attention_span(self) -> int:
        """Row width at which masked attention costs about what the layers' matmuls do (prefix_tree.cost):
        per token the matmuls grow with hidden^2 and attention with width x hidden."""
        return int(self.base.policy.model.config.get_text_config().hidden_size)

    def _activate(self) -> None:
        if self.spec is not None:
            activate(self.model, self.adapter)

    def close(self) -> None:
        """Free the run's adapter (a LoRA run) or its copy of the model."""
        if self.spec is not None:
            others = [a for a in self.model.peft_config if a != self.adapter]
            if not others:  # the last adapter on this base: drop the shared copy itself
                self.base.adapted = None
            else:
                if self.model.active_adapter == self.adapter:
                    activate(self.model, others[0])
                remove_lora(self.model, self.adapter)
        self.model, self.params, self.optimizer = None, [], None

    # ---- forward / backward -----------------------------------------------------------------
    def forward_backward(
        self, datums: list[DatumIn], loss_name: str, config: dict[str, float], forward_only: bool
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Per-datum target log-probs and {"loss:sum": ...}; gradients are added unless `forward_only`."""
        try:
            fn = loss_fn(loss_name)
        except LossInputError as exc:
            raise UserError(str(exc)) from None
        if not datums:
            raise UserError("forward_backward needs at least one datum")
        targets = [self._check(i, d, loss_name) for i, d in enumerate(datums)]
        inputs = [{k: v.float() for k, v in d.inputs.items() if k != "target_tokens"} for d in datums]
        try:  # every datum's loss inputs checked before any gradient changes
            for t, x in zip(targets, inputs):
                fn(torch.zeros(t.shape), x, config)
        except LossInputError as exc:
            raise UserError(str(exc)) from None
        self._activate()
        rows, where = pack([d.tokens for d in datums], self.micro_batch_tokens, self._attention_span)
        logprobs: list[np.ndarray | None] = [None] * len(datums)
        total = 0.0
        for lo, hi in micro_batches([len(r) for r in rows], self.micro_batch_tokens):
            members = [i for i, (r, _) in enumerate(where) if lo <= r < hi]
            paths = [(where[i][0] - lo, where[i][1]) for i in members]
            out, loss = self._micro_batch(
                rows[lo:hi],
                paths,
                [targets[i] for i in members],
                [inputs[i] for i in members],
                fn,
                config,
                forward_only,
            )
            for i, lp in zip(members, out):
                logprobs[i] = lp
            total += loss
        return logprobs, {"loss:sum": total}

    def _micro_batch(self, rows, paths, targets, inputs, fn, config, forward_only) -> tuple[list[np.ndarray], float]:
        """One forward (and backward) over a few rows of prefix trees packed into one sequence
        (service/tree_attention.py), each datum's log-probs read at its own path of nodes; losses
        are sums, so gradients add up."""
        offsets = np.cumsum([0] + [len(r) for r in rows[:-1]])
        # each datum position's node in the packed sequence, and the token it must predict there;
        # a node shared by datums that predict different tokens there is read once per distinct target
        # (a top-k datum's (T, K) targets read K tokens at each of its T nodes)
        at = [int(offsets[r]) + torch.tensor(path) for r, path in paths]  # (T,) each
        nodes = torch.cat([(n[:, None].expand_as(t) if t.dim() == 2 else n).reshape(-1) for n, t in zip(at, targets)])
        vocab = self.base.vocab_size
        flat = torch.cat([t.reshape(-1) for t in targets])  # (M,)
        pairs, which = torch.unique(nodes * vocab + flat, return_inverse=True)  # (P,), (M,)
        model = self.model.get_base_model() if self.spec is not None else self.model
        with torch.set_grad_enabled(not forward_only), tree_inputs(model.config, rows) as kwargs:
            logits = self.model(**kwargs).logits[0]  # (N, V)
            picked, _ = selected_logprobs(logits[pairs // vocab][None], (pairs % vocab)[None])  # (1, P)
            logp = [lp.view(t.shape) for lp, t in zip(picked[0][which].split([t.numel() for t in targets]), targets)]
            total = torch.stack([fn(lp, x, config) for lp, x in zip(logp, inputs)]).sum()
            if not forward_only:
                total.backward()
        return [lp.detach().numpy().copy() for lp in logp], float(total.detach())

    def _check(self, i: int, d: DatumIn, loss_name: str) -> torch.Tensor:
        vocab = self.base.vocab_size
        if not d.tokens:
            raise UserError(f"datum {i}: model_input is empty")
        check_context(self.base, len(d.tokens), f"datum {i}")
        if "target_tokens" not in d.inputs:
            raise UserError(f"datum {i}: loss_fn_inputs has no 'target_tokens'")
        target = d.inputs["target_tokens"].long()
        topk = target.dim() == 2 and target.shape[0] == len(d.tokens) and target.shape[1] >= 1
        if topk and loss_name != "cross_entropy":
            raise UserError(
                f"datum {i}: target_tokens has shape {tuple(target.shape)}, K targets per position (top-k "
                f"distillation), which only cross_entropy takes; {loss_name!r} needs shape ({len(d.tokens)},)"
            )
        if target.shape != (len(d.tokens),) and not topk:
            raise UserError(
                f"datum {i}: target_tokens has shape {tuple(target.shape)}; it must have one token per "
                f"model_input position, shape ({len(d.tokens)},), or K of them for cross_entropy, "
                f"shape ({len(d.tokens)}, K)"
            )
        for what, ids in (("model_input", torch.tensor(d.tokens)), ("target_tokens", target)):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
                raise UserError(
                    f"datum {i}: {what} holds token id {bad}, outside the vocabulary of "
                    f"{self.base.name!r} (0..{vocab - 1})"
                )
        for name, tensor in d.inputs.items():
            if name != "target_tokens" and tensor.shape != target.shape:
                raise UserError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {tuple(tensor.shape)}, target_tokens "
                    f"has {tuple(target.shape)}: they must match"
                )
        return target

    # ---- optimizer ------------------------------------------------------------------------
    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        if adam.learning_rate < 0 or not 0 <= adam.beta1 < 1 or not 0 <= adam.beta2 < 1 or adam.eps <= 0:
            raise UserError(f"Adam parameters out of range: {adam} (learning_rate >= 0, 0 <= betas < 1, eps > 0)")
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=adam.learning_rate)
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        )
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, adam.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": norm}

    # ---- weights --------------------------------------------------------------------------
    def sampler_state(self) -> dict[str, torch.Tensor]:
        if self.spec is None:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return merged_state(self.model, self.adapter)

    def save(self, path: Path, with_optimizer: bool = True) -> None:
        weights = adapter_state(self.model, self.adapter) if self.spec is not None else self.sampler_state()
        payload = {
            "base": self.base.name,
            "spec": self.spec,
            "weights": weights,
            "steps": self.steps,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None and with_optimizer else None,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(payload, tmp)
        tmp.replace(path)

    def load(self, payload: dict, with_optimizer: bool) -> None:
        if payload["base"] != self.base.name or _shape(payload["spec"]) != _shape(self.spec):
            raise UserError(
                f"checkpoint is for base {payload['base']!r} with {payload['spec']}; this run is "
                f"{self.base.name!r} with {self.spec}"
            )
        if self.spec is not None:
            load_adapter_state(self.model, payload["weights"], self.adapter)
        else:
            self.model.load_state_dict(payload["weights"])
        self.optimizer = None
        for p in self.params:
            p.grad = None
        if with_optimizer and payload["optimizer"] is not None:
            self.optimizer = torch.optim.AdamW(self.params, lr=0.0)
            self.optimizer.load_state_dict(payload["optimizer"])
            self.steps = payload["steps"]


def sampler_weights_of(payload: dict, base: BaseModel) -> dict[str, torch.Tensor]:
    """The full sampling weights of a saved run (`TrainingRun.save`'s payload): its adapter merged
    into `base` (training thread only: it borrows the base model's shared LoRA copy)."""
    if payload["spec"] is None:
        return payload["weights"]
    run = TrainingRun("restore", base, payload["spec"])
    try:
        run.load(payload, with_optimizer=False)
        return run.sampler_state()
    finally:
        run.close()


def _shape(spec: LoraSpec | None) -> LoraSpec | None:
    """What a checkpoint must match to load: everything but the seed (it only chose the initial A)."""
    return dataclasses.replace(spec, seed=None) if spec is not None else None


def micro_batches(lengths: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive index ranges whose padded size (count x longest) stays within `max_tokens`
    (a datum longer than that gets a range of its own)."""
    ranges, lo, longest = [], 0, 0
    for i, n in enumerate(lengths):
        if i > lo and max(longest, n) * (i - lo + 1) > max_tokens:
            ranges.append((lo, i))
            lo, longest = i, 0
        longest = max(longest, n)
    return ranges + [(lo, len(lengths))] if lengths else ranges


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: str) -> str:
    """`name` as one path component: every character outside [A-Za-z0-9._-] becomes '_'."""
    return _SAFE.sub("_", name)


def checkpoint_file(root: Path, model_id: str, name: str) -> Path:
    """Where `tinker://MODEL_ID/weights/NAME` is stored under `root` (names made filesystem-safe)."""
    if not name or name in (".", "..") or "/" in name:
        raise UserError(f"checkpoint name {name!r} must be a non-empty name without '/'")
    return root / safe_name(model_id) / f"{safe_name(name)}.pt"
