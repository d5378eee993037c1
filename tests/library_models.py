"""Tiny CPU builds of real model libraries' MoE code, for tests/test_model_libraries.py.

transformers (the installed release): every experts class its models decorate with
``use_experts_implementation`` is found by reading the package (``transformers_experts``),
built from its own config class with tiny sizes (``build_experts``), and put behind a
softmax top-k router (moe_models.SparseMoeBlock); ``expected_activation`` says which
registered activation its ``act_fn`` / ``_apply_gate`` computes, by evaluating it (the
recognition must follow the function, not a release's spelling). ``tiny_causal_lm`` builds
whole one-layer models of the named families, ``any_tiny_causal_lm`` two-layer models of
any family its generic settings fit. torchtitan is re-created in moe_models.py
(its dependencies are too heavy for CI; see docs/models.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
import warnings

import torch
import torch.nn.functional as F

# Attributes a config may size experts by; each set when present (lists keep their length).
TINY_SIZES = dict(hidden_size=32, moe_hidden_size=32, intermediate_size=32, moe_intermediate_size=32,
                  expert_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4,
                  moe_num_experts=4, num_experts_per_tok=2, moe_topk=2, n_group=1, topk_group=1)


@dataclasses.dataclass(frozen=True)
class ExpertsCase:
    family: str          # the models/ folder, e.g. "qwen3_moe"
    experts: type        # the experts class, e.g. Qwen3MoeExperts
    module: str          # its modeling module
    grouped_mm: bool     # decorated with use_experts_implementation (else an eager loop only)

    def __str__(self):
        return f"{self.family}-{self.experts.__name__}"


@functools.cache
def transformers_experts() -> tuple[ExpertsCase, ...]:
    """Every experts class of the installed transformers with an ``_apply_gate`` (the
    decorator ``use_experts_implementation`` adds one; a few eager-only classes define
    their own): ``grouped_mm`` says whether the decorator wrapped its forward."""
    import transformers.models

    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.iter_modules(transformers.models.__path__):
            name = f"transformers.models.{info.name}.modeling_{info.name}"
            try:
                module = importlib.import_module(name)
            except Exception:  # a family whose optional dependency is missing
                continue
            for cls in vars(module).values():
                if (inspect.isclass(cls) and cls.__module__ == name and issubclass(cls, torch.nn.Module)
                        and "_apply_gate" in vars(cls) and "Experts" in cls.__name__):
                    decorated = getattr(cls.forward, "__wrapped__", None) is not None
                    found.append(ExpertsCase(info.name, cls, name, decorated))
    return tuple(found)


def _configs(module_name: str) -> list[type]:
    from transformers import PretrainedConfig

    module = importlib.import_module(module_name)
    configs = [v for v in vars(module).values() if inspect.isclass(v) and issubclass(v, PretrainedConfig)]
    return sorted(configs, key=lambda c: ("Text" not in c.__name__, len(c.__name__)))


def _shrink(config) -> None:
    for key, value in TINY_SIZES.items():
        if not hasattr(config, key):
            continue
        current = getattr(config, key)
        try:
            setattr(config, key, [value] * len(current) if isinstance(current, (list, tuple)) else value)
        except Exception:  # a strict field of another type
            pass


def build_experts(case: ExpertsCase, dtype=torch.bfloat16) -> torch.nn.Module:
    """The experts module built from its family's config with tiny sizes, on the
    grouped_mm implementation; raises when no config class of the family builds it small."""
    errors = []
    for config_class in _configs(case.module):
        try:
            config = config_class()
            _shrink(config)
            config._experts_implementation = "grouped_mm"
            params = inspect.signature(case.experts.__init__).parameters
            kwargs = {}
            if "intermediate_size" in params and isinstance(getattr(config, "moe_intermediate_size", None),
                                                            (list, tuple)):  # per-modality sizes (Ernie VL)
                kwargs["intermediate_size"] = 32
            if "layer_idx" in params and params["layer_idx"].default is inspect.Parameter.empty:
                kwargs["layer_idx"] = 0  # per-layer settings (5.25's bailing_hybrid, step3p7: SwiGLU clip limits)
            experts = case.experts(config, **kwargs)
        except Exception as e:
            errors.append(f"{config_class.__name__}: {type(e).__name__}: {e}"[:200])
            continue
        numel = sum(p.numel() for p in experts.parameters())
        if numel > 100_000:
            errors.append(f"{config_class.__name__}: {numel} parameters")
            continue
        torch.manual_seed(0)
        for p in experts.parameters():  # the module leaves them uninitialised
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
        return experts.to(dtype)
    raise RuntimeError(f"no config of {case.family} builds {case.experts.__name__} small: {errors}")


def expected_activation(experts: torch.nn.Module) -> str | None:
    """The registered activation the experts compute between their GEMMs, found by
    evaluating their own ``_apply_gate`` / ``act_fn`` on random values (fp32): "swiglu"
    (silu(gate) * up of the two halves), "srelu" (relu(h)**2), or None (anything else)."""
    gen = torch.Generator().manual_seed(0)
    width = 2 * 16 if getattr(experts, "has_gate", True) else 16
    h = torch.randn(8, width, generator=gen) * 3
    with torch.no_grad():
        if getattr(experts, "has_gate", True):
            if not getattr(experts, "is_concatenated", True):
                return None
            got = experts._apply_gate(h)
            want = F.silu(h[:, :16]) * h[:, 16:]
            return "swiglu" if got.shape == want.shape and torch.allclose(got, want, atol=1e-5) else None
        got = experts.act_fn(h)
    return "srelu" if torch.allclose(got, F.relu(h) ** 2, atol=1e-5) else None


# ----------------------------------------------------------------------------- whole models

_COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=64, num_experts_per_tok=2)


def tiny_causal_lm(family: str, dtype=torch.bfloat16, experts_implementation="grouped_mm"):
    """A one-layer, one-MoE-layer CausalLM of ``family`` (hidden 32, 4 experts, top-2)."""
    import transformers as tf

    configs = {
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=32,
                                               head_dim=16, num_experts=4),
        "mixtral": lambda: tf.MixtralConfig(**_COMMON, intermediate_size=32, head_dim=16, num_local_experts=4),
        "olmoe": lambda: tf.OlmoeConfig(**_COMMON, intermediate_size=32, num_experts=4),
        "gpt_oss": lambda: tf.GptOssConfig(**_COMMON, intermediate_size=32, head_dim=16, num_local_experts=4,
                                           layer_types=["full_attention"]),
    }
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.AutoModelForCausalLM.from_config(configs[family](), experts_implementation=experts_implementation,
                                                   dtype=dtype)


# What a tiny whole model of any family sets where its config has the field: 2 decoder
# layers, every MLP layer an MoE layer, no multi-token-prediction layer, MLA's ranks small,
# a padding token inside the vocabulary.
TINY_MODEL = dict(vocab_size=64, pad_token_id=0, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, max_position_embeddings=64, first_k_dense_replace=0, n_shared_experts=1,
                  kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                  decoder_sparse_step=1, moe_layer_freq=1, mlp_only_layers=[], num_nextn_predict_layers=0)


def _set(config, key, value) -> None:
    try:
        setattr(config, key, value)
    except Exception:  # a read-only or validated field: the family keeps its own
        pass


def any_tiny_causal_lm(family: str, dtype=torch.bfloat16, **settings):
    """A two-layer CausalLM of ``family`` from its own config class (its text config too),
    with TINY_SIZES and TINY_MODEL (updated by `settings`) where the config has them, MLA's
    head_dim its rope dimension, one layer of each attention kind, and every MLP layer
    sparse. Built by AutoModelForCausalLM; for a vision-language family it does not take, its
    text decoder alone: the CausalLM of its text config, or else the text model (whose output
    has no logits: ``Logits`` takes its last hidden state); else by the family's own class
    for the text config, then for the config (``_own_class``).
    A family that keeps sizes per layer gets its decoder's config made anew (``_remade``).
    Raises where the family needs more than that (a vision tower with no text model of its own)."""
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[family]()
    text = config.get_text_config(decoder=True)  # a vision-language family's decoder (Qwen3-Omni's: its thinker's)
    text = None if text is config else text
    if getattr(text or config, "per_layer_attributes", None):  # sizes kept per layer: its decoder made anew, small
        config, text = _remade(text or config, settings), None
    for c in [config] + ([text] if text is not None else []):
        if getattr(c, "per_layer_attributes", None):
            continue
        _shrink(c)
        for key, value in {**TINY_MODEL, **settings}.items():
            if hasattr(c, key):
                _set(c, key, value)
        if getattr(c, "qk_rope_head_dim", None) and hasattr(c, "head_dim") and "head_dim" not in settings:
            _set(c, "head_dim", c.qk_rope_head_dim)
        if isinstance(getattr(c, "mlp_layer_types", None), (list, tuple)):
            _set(c, "mlp_layer_types", ["sparse"] * c.num_hidden_layers)
        if isinstance(getattr(c, "layer_types", None), (list, tuple)) and c.layer_types:
            kinds = list(dict.fromkeys(c.layer_types))
            _set(c, "layer_types", (kinds * c.num_hidden_layers)[:c.num_hidden_layers])

    def own(c, **kwargs):
        return _own_class(family, c)._from_config(c, **kwargs)

    builds = [(tf.AutoModelForCausalLM.from_config, config)]
    if text is not None:
        builds += [(tf.AutoModelForCausalLM.from_config, text), (tf.AutoModel.from_config, text), (own, text)]
    builds.append((own, config))
    for i, (build, c) in enumerate(builds):
        torch.manual_seed(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return build(c, experts_implementation="grouped_mm", dtype=dtype)
        except ValueError as e:  # "Unrecognized configuration class ...", or no class of the family's own
            if not str(e).startswith(("Unrecognized configuration class", "no model class")) or i == len(builds) - 1:
                raise


def _remade(config, settings: dict):
    """A config that keeps sizes per layer (its ``per_layer_attributes`` in ``per_layer_config``,
    filled in from the global fields when the config is made, so setting one later reaches
    no layer), made anew: TINY_SIZES and TINY_MODEL where it has the field, one layer of each
    kind its default has, every MLP layer sparse, then `settings` (a family's own, fields or
    not: the kwargs that fill its layers in)."""
    fields = getattr(type(config), "__dataclass_fields__", {})
    layers = TINY_MODEL["num_hidden_layers"]
    values = {key: value for key, value in {**TINY_SIZES, **TINY_MODEL}.items() if key in fields}
    values["layer_types"] = (list(dict.fromkeys(config.layer_types)) * layers)[:layers]
    if "mlp_layer_types" in fields:
        values["mlp_layer_types"] = ["sparse"] * layers
    return type(config)(**{**values, **settings})


def _own_class(family: str, config):
    """The family's own class for `config` where no Auto class takes it (transformers leaves
    some families' CausalLM, and vision-language families' text models, out of the Auto
    mappings): its CausalLM, else its text model, else its model."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    classes = [cls for cls in vars(module).values() if isinstance(cls, type) and "PreTrained" not in cls.__name__
               and getattr(cls, "config_class", None) is type(config)]
    for suffix in ("ForCausalLM", "TextModel", "Model"):
        for cls in classes:
            if cls.__name__.endswith(suffix):
                return cls
    raise ValueError(f"no model class of {family} takes {type(config).__name__}")


def experts_layers(model: torch.nn.Module) -> int:
    """How many of the model's modules are transformers experts classes."""
    classes = tuple(case.experts for case in transformers_experts())
    return sum(isinstance(m, classes) for m in model.modules())


def experts_called(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    """How many of the model's experts modules one forward on `input_ids` calls (a
    vision-language decoder's vision experts run only on image tokens)."""
    classes = tuple(case.experts for case in transformers_experts())
    called = set()
    hooks = [m.register_forward_hook(lambda m, args, out: called.add(m)) for m in model.modules()
             if isinstance(m, classes)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return len(called)


class Logits(torch.nn.Module):
    """``model(input_ids).logits`` as a module, so compare() sees the model's parameters (a
    text model's last hidden state where its output has no logits)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids)
        return out.logits if "logits" in out else out.last_hidden_state


def input_ids(seed=0, batch=2, length=8):
    return torch.randint(0, _COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))
