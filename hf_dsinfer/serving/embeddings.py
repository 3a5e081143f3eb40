"""Sentence embeddings on the fused encoder layers: what ``hf-dsinfer serve --runner pooling`` runs.

A folder is read the way sentence-transformers reads it, without needing sentence-transformers installed:
``modules.json`` lists the modules (Transformer, Pooling, Dense, Normalize), ``1_Pooling/config.json`` the pooling
modes, ``sentence_bert_config.json`` ``max_seq_length`` and ``do_lower_case``. The Transformer module is loaded with
``AutoModel.from_pretrained(path, inference_config=...)``, so its encoder layers are the fused ones; pooling, dense
layers and normalization run here in fp32 on the model's output.

A plain HF folder (no ``modules.json``) gets vLLM's default pooler for its kind: ``CLS`` for BERT-family encoders
(vLLM's ``BertEmbeddingModel`` and its RoBERTa subclass), ``LAST`` for decoders (vLLM's ``as_embedding_model``), both
L2-normalized; ``pooler_config`` (vLLM's ``--pooler-config``: ``pooling_type``, ``use_activation``) overrides it.
The longest input is ``max_seq_length`` when the folder sets it (vLLM reads it the same way), else the smaller of the
tokenizer's ``model_max_length`` and the model's positions.

The HTTP route is :class:`~hf_dsinfer.serving.embedding_routes.EmbeddingService`.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..log import logger

__all__ = ["Embedder", "PoolingSpec", "detect_runner", "pool", "read_pooling_spec"]

#: sentence-transformers' pooling modes, in the order it concatenates them when several are on.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}  # fmt: skip
#: vLLM's ``pooling_type`` names (``--pooler-config``) and the sentence-transformers mode each one is.
VLLM_POOLING_TYPES = {"CLS": "cls", "MEAN": "mean", "LAST": "lasttoken"}
#: Architectures that generate text: a folder whose architectures are all something else is an encoder to pool.
_GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForSeq2SeqLM")
#: Encoder families: right-padded (absolute positions count from column 0), and vLLM's default pooler is ``CLS``.
#: Every other model is taken as a decoder: left-padded (the fused decoder layers take left padding only; positions
#: start at each row's first real token) and pooled at its last token by default.
_ENCODER_FAMILIES = (
    "bert", "roberta", "xlm-roberta", "distilbert", "camembert", "electra", "modernbert", "nomic_bert", "mpnet",
    "albert", "deberta", "deberta-v2", "new",
)  # fmt: skip


@dataclass
class PoolingSpec:
    """How token states become one vector: ``modes`` (sentence-transformers' names, concatenated in this order),
    ``dense`` layers after pooling (``(linear, activation)``), then L2 ``normalize``. ``source`` says where it came
    from (for logs and errors)."""

    modes: tuple[str, ...]
    normalize: bool
    source: str
    dense: list[tuple[nn.Linear, nn.Module]] = field(default_factory=list)


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _pooling_modes(config: dict, where: str) -> tuple[str, ...]:
    """The modes of a ``1_Pooling/config.json``, old (``pooling_mode_*_tokens`` booleans) or new (``pooling_mode``)."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(m for key, m in _LEGACY_MODE_KEYS.items() if config.get(key))
        modes = modes or ("mean",)  # sentence-transformers' default when no flag is on
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown:
        raise ValueError(f"{where}: pooling mode {unknown[0]!r} is not one of {', '.join(POOLING_MODES)}")
    return modes


def _load_dense(folder: str) -> tuple[nn.Linear, nn.Module]:
    """A sentence-transformers ``Dense`` module: ``config.json`` (sizes, bias, a ``torch.nn`` activation) + weights."""
    config = _read_json(os.path.join(folder, "config.json"))
    _check_sentence_embedding(config, folder)
    if config.get("use_residual"):
        raise ValueError(f"{folder}: a Dense module with use_residual is not supported here")
    linear = nn.Linear(config["in_features"], config["out_features"], bias=config.get("bias", True))
    weights = os.path.join(folder, "model.safetensors")
    if os.path.exists(weights):
        from safetensors.torch import load_file

        state = load_file(weights)
    else:
        state = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    name = config.get("activation_function") or "torch.nn.modules.linear.Identity"
    module_name, _, class_name = name.rpartition(".")
    if not module_name.startswith("torch.nn"):
        raise ValueError(f"{folder}: Dense activation {name!r} is not a torch.nn module; only those load without code")
    activation = getattr(importlib.import_module(module_name), class_name)()
    return linear.float().eval(), activation


def _check_sentence_embedding(config: dict, folder: str) -> None:
    """Dense and Normalize act on the pooled vector here; one configured for token states is refused by name."""
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, "sentence_embedding"):
            raise ValueError(f"{folder}: {key}={config[key]!r} is not supported here (modules after pooling act on "
                             "the sentence embedding)")  # fmt: skip


def read_pooling_spec(path: str) -> tuple[str, PoolingSpec | None, dict]:
    """Read a sentence-transformers folder: ``(model folder, pooling, sentence_bert_config)``.

    Returns ``(path, None, {})`` for a folder without ``modules.json`` (a plain HF model). Modules other than
    Transformer, Pooling, Dense and Normalize (a Normalize anywhere but last) raise ValueError naming them.
    """
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return path, None, {}
    model_dir, modes, dense, normalize, st_config = path, None, [], False, {}
    for module in sorted(_read_json(modules_file), key=lambda m: m.get("idx", 0)):
        kind = module["type"].rpartition(".")[2]
        folder = os.path.join(path, module.get("path", ""))
        if normalize:
            raise ValueError(f"{modules_file}: a {kind} module after Normalize is not supported (Normalize comes last)")
        if kind == "Transformer":
            model_dir = folder
            config_file = os.path.join(folder, "sentence_bert_config.json")
            st_config = _read_json(config_file) if os.path.isfile(config_file) else {}
        elif kind == "Pooling":
            modes = _pooling_modes(_read_json(os.path.join(folder, "config.json")), os.path.join(folder, "config.json"))
        elif kind == "Dense":
            dense.append(_load_dense(folder))
        elif kind == "Normalize":
            config_file = os.path.join(folder, "config.json")
            _check_sentence_embedding(_read_json(config_file) if os.path.isfile(config_file) else {}, folder)
            normalize = True
        else:
            raise ValueError(
                f"{modules_file}: the sentence-transformers module {module['type']} is not supported here "
                "(Transformer, Pooling, Dense and Normalize are); serve this model with sentence-transformers itself"
            )
    if modes is None:
        raise ValueError(f"{modules_file} has no Pooling module: nothing says how to pool the token states")
    return model_dir, PoolingSpec(modes, normalize, f"sentence-transformers ({path})", dense), st_config


def _default_spec(model_type: str, pooler_config: dict) -> PoolingSpec:
    """vLLM's default pooler for a plain folder; ``pooler_config`` (``pooling_type``, ``use_activation``) overrides."""
    unknown = sorted(set(pooler_config) - {"pooling_type", "use_activation"})
    if unknown:
        raise ValueError(f"pooler_config: '{unknown[0]}' is not supported here (pooling_type and use_activation are)")
    kind = pooler_config.get("pooling_type") or ("CLS" if model_type in _ENCODER_FAMILIES else "LAST")
    if kind not in VLLM_POOLING_TYPES:
        raise ValueError(f"pooler_config: pooling_type {kind!r} is not one of {', '.join(VLLM_POOLING_TYPES)}")
    normalize = pooler_config.get("use_activation")
    source = "--pooler-config" if pooler_config else f"vLLM's default for {model_type}"
    return PoolingSpec((VLLM_POOLING_TYPES[kind],), True if normalize is None else bool(normalize), source)


def detect_runner(path: str) -> str:
    """``"pooling"`` for a sentence-transformers folder or a model with no generating head, else ``"generate"``."""
    if os.path.isfile(os.path.join(path, "modules.json")):
        return "pooling"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(a.endswith(_GENERATIVE_SUFFIXES) for a in architectures):
        return "pooling"
    if not architectures and config.model_type in _ENCODER_FAMILIES:
        return "pooling"
    return "generate"


def pool(hidden: torch.Tensor, lengths: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """``[B, T, C]`` token states of right-padded rows (``lengths`` ``[B]`` real tokens) -> ``[B, C * len(modes)]``,
    each mode as sentence-transformers computes it, concatenated in the given order."""
    B, T, C = hidden.shape
    positions = torch.arange(T, device=hidden.device)  # [T]
    mask = (positions[None, :] < lengths[:, None]).to(hidden.dtype)[..., None]  # [B, T, 1]
    count = lengths.to(hidden.dtype)[:, None]  # [B, 1]
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[:, 0])
        elif mode == "lasttoken":
            out.append(hidden[torch.arange(B, device=hidden.device), lengths - 1])
        elif mode == "max":
            out.append(hidden.masked_fill(mask == 0, float("-inf")).amax(dim=1))
        elif mode == "mean":
            out.append((hidden * mask).sum(dim=1) / count)
        elif mode == "mean_sqrt_len_tokens":
            out.append((hidden * mask).sum(dim=1) / count.sqrt())
        elif mode == "weightedmean":  # weights 1, 2, ... by position (rows start at column 0: right padding)
            weights = mask * (positions + 1).to(hidden.dtype)[None, :, None]  # [B, T, 1]
            out.append((hidden * weights).sum(dim=1) / weights.sum(dim=1))
        else:
            raise ValueError(f"pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")
    return torch.cat(out, dim=-1)


class Embedder:
    """A model folder ready to embed token ids: the fused encoder, its tokenizer and its pooling.

    Use :meth:`from_pretrained`. Attributes: ``max_model_len`` (the longest input), ``dimension`` (of the pooled
    vector), ``matryoshka`` (None: ``dimensions`` not supported; else the allowed sizes, empty: any up to
    ``dimension``), ``do_lower_case`` (lowercase text before tokenizing, as sentence-transformers does).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, spec: PoolingSpec, max_model_len: int,
                 do_lower_case: bool = False):  # fmt: skip
        self.model, self.tokenizer, self.spec = model.eval(), tokenizer, spec
        self.max_model_len, self.do_lower_case = max_model_len, do_lower_case
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.left_pad = model.config.model_type not in _ENCODER_FAMILIES  # see _ENCODER_FAMILIES
        device = next(model.parameters()).device
        spec.dense = [(linear.to(device), activation) for linear, activation in spec.dense]
        config = model.config
        width = config.hidden_size * len(spec.modes)
        self.dimension = spec.dense[-1][0].out_features if spec.dense else width
        sizes = getattr(config, "matryoshka_dimensions", None)
        self.matryoshka = list(sizes) if sizes else ([] if getattr(config, "is_matryoshka", False) else None)

    @classmethod
    def from_pretrained(cls, path: str, inference_config: Any = None, pooler_config: dict | None = None) -> Embedder:
        """Load ``path`` (a sentence-transformers folder or a plain HF model) on fused layers.

        Args:
            path: the folder.
            inference_config: an InferenceConfig, a dict or a JSON path (None: the defaults); a checkpoint saved
                with one reloads with it.
            pooler_config: vLLM's ``--pooler-config`` keys ``pooling_type`` (CLS, MEAN, LAST) and ``use_activation``
                (normalize); for a plain folder only (a sentence-transformers folder says how it pools).
        """
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        from ..integration.config import InferenceConfig

        model_dir, spec, st_config = read_pooling_spec(path)
        config = AutoConfig.from_pretrained(model_dir)
        if spec is None:
            spec = _default_spec(config.model_type, pooler_config or {})
        elif pooler_config:
            raise ValueError(f"--pooler-config: {path} is a sentence-transformers folder, whose modules.json already "
                             "says how to pool; leave --pooler-config out")  # fmt: skip
        saved = getattr(config, "quantization_config", None)
        saved_method = saved.get("quant_method") if isinstance(saved, dict) else getattr(saved, "quant_method", None)
        kwargs = {}
        if inference_config is not None or str(saved_method) != "dsinfer":
            kwargs["inference_config"] = InferenceConfig.from_any(inference_config)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModel.from_pretrained(model_dir, **kwargs)
        max_len = st_config.get("max_seq_length") or _max_positions(config, tokenizer)
        embedder = cls(model, tokenizer, spec, int(max_len), bool(st_config.get("do_lower_case", False)))
        logger.info("hf_dsinfer embeddings: %s, pooling %s%s (%s), max_model_len %d", path, "+".join(spec.modes),
                    " + normalize" if spec.normalize else "", spec.source, embedder.max_model_len)  # fmt: skip
        return embedder

    # -- tokens ------------------------------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """``(ids, special mask)`` of ``text`` (lowercased first when the folder says ``do_lower_case``)."""
        if self.do_lower_case:
            text = text.lower()
        enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_special_tokens_mask=True)
        return enc["input_ids"], enc["special_tokens_mask"]

    # -- the model ---------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]], max_batch_tokens: int = 8192) -> torch.Tensor:
        """Pooled vectors (pooling and Dense layers, not normalized) of each token list: ``[N, dimension]`` fp32.

        Rows are sorted by length and run in forwards of at most ``max_batch_tokens`` padded tokens (one row at
        least), with an attention mask: right-padded for encoders, left-padded for decoders (then the rows are
        shifted back before pooling, so pooling always sees right-padded rows).
        """
        order = sorted(range(len(token_lists)), key=lambda i: -len(token_lists[i]))
        out = torch.empty(len(token_lists), self.dimension)
        device = next(self.model.parameters()).device
        start = 0
        while start < len(order):
            width = len(token_lists[order[start]])  # the longest row of this forward
            rows = max(1, min(len(order) - start, max_batch_tokens // max(width, 1)))
            chunk = order[start : start + rows]
            ids = torch.full((rows, width), self.pad_id, dtype=torch.long)  # [B, T]
            lengths = torch.tensor([len(token_lists[i]) for i in chunk])  # [B]
            columns = torch.arange(width)  # [T]
            shift = (width - lengths) if self.left_pad else torch.zeros_like(lengths)  # [B]: padding before the row
            for r, i in enumerate(chunk):
                ids[r, shift[r] : shift[r] + lengths[r]] = torch.tensor(token_lists[i])
            mask = ((columns[None, :] >= shift[:, None]) & (columns[None, :] < (shift + lengths)[:, None])).long()
            hidden = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # [B,T,C]
            if self.left_pad:  # row r's tokens start at column shift[r]: gather them to the front
                index = ((columns[None, :] + shift[:, None]) % width).to(device)  # [B, T]
                hidden = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
            pooled = pool(hidden.float(), lengths.to(device), self.spec.modes)  # [B, C * modes]
            for linear, activation in self.spec.dense:
                pooled = activation(linear(pooled))
            out[chunk] = pooled.cpu()
            start += rows
        return out

    def finish(self, pooled: torch.Tensor, dimensions: int | None, normalize: bool | None) -> torch.Tensor:
        """The answer's vectors from :meth:`embed`'s: cut to ``dimensions`` (Matryoshka), then L2-normalized when
        ``normalize`` (None: as the folder says), in that order as vLLM does."""
        if dimensions is not None:
            pooled = pooled[:, :dimensions]
        if self.spec.normalize if normalize is None else normalize:
            pooled = nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled


def _max_positions(config: Any, tokenizer: Any) -> int:
    """The longest input of a plain folder: the tokenizer's ``model_max_length`` capped by the model's positions."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and config.model_type in ("roberta", "xlm-roberta", "camembert"):
        positions -= (config.pad_token_id or 0) + 1  # positions count from padding_idx + 1
    limits = [n for n in (positions, getattr(tokenizer, "model_max_length", None)) if n and n < 10**9]
    if not limits:
        raise ValueError("neither the model config (max_position_embeddings) nor the tokenizer (model_max_length) "
                         "says how long an input may be; set max_seq_length in sentence_bert_config.json")  # fmt: skip
    return min(limits)
