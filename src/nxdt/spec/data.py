"""The data side of a config: the blend (`data.data_prefix`, or `data.datasets` + `data.weights`),
which data module it gets, the data keys' cross-checks (`check_data`), and dynamic data
selection's domains and reference losses. Validation and the data modules read the same values,
so the two cannot disagree. Torch-free."""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from nxdt.config.errors import ConfigError
from nxdt.spec.alignment import Alignment, alignment_of


# --------------------------------------------------------------------------- blend
SPLIT_NAMES = ("train", "validation", "test")
# spellings of a split in the {train, validation, test} form -> the split
SPLIT_ALIASES = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation",
                 "test": "test"}

Pairs = tuple[tuple[float, str], ...]


@dataclass(frozen=True)
class DataBlend:
    """A parsed blend: `blend` (weight, path) pairs cut into splits by data.splits_string, or
    `split_blends` (split name -> pairs) for the {train, validation, test} form. Exactly one is set."""

    blend: Pairs | None = None
    split_blends: Mapping[str, Pairs] | None = None

    @property
    def paths(self) -> list[str]:
        """Every path prefix named, in order (a path named twice appears twice)."""
        if self.blend is not None:
            return [p for _, p in self.blend]
        return [p for pairs in (self.split_blends or {}).values() for _, p in pairs]

    def pairs(self, split: str) -> Pairs:
        """The (weight, path) pairs that feed `split` (the whole blend when it is cut by splits_string)."""
        if self.blend is not None:
            return self.blend
        return (self.split_blends or {}).get(split, ())


def _one_line(value: Any) -> str:
    return " ".join(str(value).split())


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def _weight(value: Any) -> float | None:
    """A finite non-negative weight (numbers and numeric strings), else None."""
    if isinstance(value, bool):
        return None
    try:
        w = float(value)
    except (TypeError, ValueError):
        return None
    return w if math.isfinite(w) and w >= 0 else None


def _pairs(value: Any, key: str) -> Pairs:
    """A path, [path] or [w, p, w, p, ...] -> (weight, path) pairs with a positive weight sum."""
    if _is_path(value):
        return ((1.0, str(value)),)
    items = list(value) if isinstance(value, Sequence) else None
    if items is not None and len(items) == 1 and _is_path(items[0]):
        return ((1.0, str(items[0])),)
    ok = items is not None and len(items) >= 2 and len(items) % 2 == 0
    pairs = []
    for i in range(0, len(items), 2) if ok else ():
        w, p = _weight(items[i]), items[i + 1]
        if w is None or not _is_path(p):
            ok = False
            break
        pairs.append((w, str(p)))
    if not ok:
        raise ConfigError(f"{key}: expected [weight, path, weight, path, ...], a path, or "
                          f"{{train, validation, test}}, got {_one_line(value)}")
    if sum(w for w, _ in pairs) <= 0:
        raise ConfigError(f"{key}: the weights sum to zero")
    return tuple(pairs)


def parse_data_prefix(data_prefix: Any, key: str = "data.data_prefix") -> DataBlend:
    """Parse `data.data_prefix` (see the module docstring); ConfigError naming `key` when malformed.

    Accepts plain containers and OmegaConf ones (anything Mapping / Sequence)."""
    if data_prefix is None:
        raise ConfigError(f"{key}: required for the megatron data module (paths without .bin/.idx)")
    if isinstance(data_prefix, Mapping):
        split_blends: dict[str, Pairs] = {}
        for name, value in data_prefix.items():
            name = str(name)
            if name not in SPLIT_ALIASES:
                close = difflib.get_close_matches(name, SPLIT_NAMES, n=1, cutoff=0.6)
                hint = f" (did you mean '{key}.{close[0]}'?)" if close else ""
                raise ConfigError(f"unknown key '{key}.{name}'{hint}")
            if value is not None:
                split_blends[SPLIT_ALIASES[name]] = _pairs(value, f"{key}.{name}")
        if "train" not in split_blends:
            raise ConfigError(f"{key}.train: the dict form needs a train entry")
        return DataBlend(split_blends=split_blends)
    return DataBlend(blend=_pairs(data_prefix, key))


def parse_datasets(datasets: Sequence[Any] | None, weights: Sequence[Any] | None) -> DataBlend:
    """fms-fsdp's `data.datasets` + `data.weights` (default: 1 each) -> a blend cut by splits_string.

    With `datasets` null only the weights are checked (there is nothing to weigh: empty blend)."""
    names = None if datasets is None else [str(p) for p in datasets]
    if names is not None and weights is not None and len(weights) != len(names):
        raise ConfigError(f"data.weights has {len(weights)} entries but data.datasets has {len(names)}")
    if weights is not None:
        ws = [_weight(w) for w in weights]
        if any(w is None for w in ws) or sum(ws) <= 0:
            raise ConfigError(f"data.weights: {list(weights)} must be non-negative with a positive sum")
    if names is None:
        return DataBlend(blend=())
    if not names:
        raise ConfigError("data.datasets: give at least one dataset (Megatron prefixes without .bin/.idx)")
    ws = [1.0] * len(names) if weights is None else [float(w) for w in weights]
    return DataBlend(blend=tuple(zip(ws, names)))


def data_blend(data: Any) -> DataBlend:
    """The blend a `data` section trains on: `datasets` (+ `weights`) when set, else `data_prefix`
    (ConfigError when neither is set); `data.prob_map` (LLaMA-MoE's presets) sets the weights."""
    if data.datasets is not None:
        blend = parse_datasets(data.datasets, data.weights)
    else:
        blend = parse_data_prefix(data.data_prefix)
    return blend if getattr(data, "prob_map", None) is None else preset_weights(blend, data)


# LLaMA-MoE's presets by SlimPajama domain (smoe/data/dynamic_selection.py of pjlab-sys4nlp/llama-moe at
# b17aff4): `--prob_map` llama (its default: LLaMA's portions), sheared_llama (Sheared-LLaMA's), uniform;
# and Llama-2-7B's SlimPajama validation losses, the reference its dynamic selection moves the blend by
SLIMPAJAMA_DOMAINS = ("en_cc", "en_c4", "github", "en_wikipedia", "en_book", "en_arxiv", "en_stack")
PROB_MAPS: dict[str, dict[str, float]] = {
    "llama": dict(zip(SLIMPAJAMA_DOMAINS, (0.67, 0.15, 0.045, 0.045, 0.045, 0.025, 0.02))),
    "sheared_llama": dict(zip(SLIMPAJAMA_DOMAINS, (0.361, 0.492, 0.008, 0.031, 0.091, 0.007, 0.01))),
    "uniform": dict.fromkeys(SLIMPAJAMA_DOMAINS, 1 / 7),
}
REFERENCE_PRESETS: dict[str, dict[str, float]] = {
    "llama2_7b_slimpajama": {"en_book": 1.925248146057129, "en_wikipedia": 1.5899001359939575,
                             "en_stack": 1.4974864721298218, "github": 0.6984495520591736,
                             "en_c4": 2.074881076812744, "en_cc": 1.6916865110397339, "en_arxiv": 1.2408167123794556},
}
_MEGATRON_SUFFIX = "_text_document"  # Megatron's preprocess names its outputs <name>_text_document


def slimpajama_domain(name: str) -> str:
    """A dataset's SlimPajama domain: its name (the path's last component), without Megatron's suffix."""
    return name[: -len(_MEGATRON_SUFFIX)] if name.endswith(_MEGATRON_SUFFIX) else name


def preset_weights(blend: DataBlend, data: Any) -> DataBlend:
    """The blend with `data.prob_map`'s weights, each dataset matched to its SlimPajama domain by name."""
    key = "data.prob_map"
    if blend.blend is None:
        raise ConfigError(f"{key}: weighs the datasets of data.datasets or data.data_prefix's list form, not the "
                          "{train, validation, test} form")
    if data.weights is not None:
        raise ConfigError(f"{key} ({data.prob_map}) sets the blend's weights: remove data.weights")
    table, paths = PROB_MAPS[data.prob_map], [p for _, p in blend.blend]
    domains = [slimpajama_domain(n) for n in domain_names(paths)]
    unknown = [n for n in domains if n not in table]
    if unknown:
        raise ConfigError(f"{key} {data.prob_map}: dataset '{unknown[0]}' is not a SlimPajama domain (name each "
                          f"dataset's folder or prefix after one of: {', '.join(SLIMPAJAMA_DOMAINS)})")
    return DataBlend(blend=tuple((table[d], p) for d, p in zip(domains, paths)))


# --------------------------------------------------------------------------- data kind
NO_DATA_SOURCE = ("data: no data source; set data.data_prefix (Megatron), data.train_dir (HF datasets), "
                  "data.datasets, data.use_dummy_dataset, model_alignment_strategy.sft or data.data_module")


def datamodule_kind(cfg, alignment: Alignment | None = None) -> str:
    """'custom' | 'sft' | 'preference' | 'dummy' | 'logical_shards' | 'hf' | 'megatron' for `cfg` (see
    nxdt.data.select); ConfigError when the config names no data source. `alignment`: the run
    spec's (default: read from `cfg`)."""
    kind = data_kind_of(cfg, alignment_of(cfg) if alignment is None else alignment)
    if kind is None:
        raise ConfigError(NO_DATA_SOURCE)
    return kind


def data_kind_of(cfg, alignment: Alignment) -> str | None:
    """`datamodule_kind`, None when the config names no data source (the run spec's `data_kind`)."""
    data = cfg.data
    if data.data_module is not None:
        return "custom"
    if alignment.sft is not None:
        return "sft"
    if alignment.preference is not None:
        return "preference"
    if data.use_dummy_dataset:
        return "dummy"
    if data.datasets is not None:
        return "logical_shards"
    if data.dynamic_data_selection != "none" and data.data_prefix and not (
            data.train_dir is not None and (cfg.model_source == "hf" or data.use_sft_style_data_module)):
        return "logical_shards"  # a Megatron blend whose weights change: read as logical-shard streams
    has_prefix = bool(data.data_prefix)
    if data.train_dir is not None and (
            cfg.model_source == "hf" or data.use_sft_style_data_module or not has_prefix):
        return "hf"
    if has_prefix:
        return "megatron"
    return None


# --------------------------------------------------------------------------- data checks
def check_data(cfg: Any, alignment: Alignment, kind: str | None) -> None:
    """The data keys' cross-checks: splits, the blend, packing, a custom module's name, dynamic selection.
    `kind`: the run spec's data_kind (None: no data source)."""
    data = cfg.data
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*(,\s*\d+(\.\d+)?\s*){2}", data.splits_string):
        raise ConfigError(f"data.splits_string: expected three comma-separated numbers like '980,10,10', "
                          f"got '{data.splits_string}'")
    if data.datasets is not None or data.weights is not None:
        parse_datasets(data.datasets, data.weights)
    if data.prob_map is not None:
        data_blend(data)  # the preset matches every dataset to a domain
    if data.packing and alignment.sft is None:
        if data.use_sft_style_data_module and alignment.preference is None:
            # NxDT before model_alignment_strategy (2.20): SFT was use_sft_style_data_module + packing
            raise ConfigError("data.packing: SFT is model_alignment_strategy.sft since NxDT 2.21; this config predates "
                              "it: add model_alignment_strategy.sft.packing=true to the command line")
        raise ConfigError("data.packing: packing applies to SFT data only (set model_alignment_strategy.sft)")
    if data.data_module is not None and not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", data.data_module):
        raise ConfigError(f"data.data_module: expected 'package.module.ClassName', got '{data.data_module}'")
    if data.data_module is None and data.data_prefix is not None:
        parse_data_prefix(data.data_prefix)
    check_dynamic_selection(cfg, kind)


# --------------------------------------------------------------------------- data selection
REFERENCE_LOSSES_KEY = "data.dynamic_selection.reference_losses"


def domain_names(paths: Sequence[str]) -> list[str]:
    """A short, unique name per domain: the path's last component (`#i` appended to repeats)."""
    base = [os.path.basename(os.path.normpath(str(p))) or str(p) for p in paths]
    return [b if base.count(b) == 1 else f"{b}#{i}" for i, b in enumerate(base)]


def domain_paths(data: Any) -> list[str]:
    """The training blend's paths, in order (ConfigError for the per-split form, which has no
    per-domain held-out range)."""
    blend = data_blend(data)
    if blend.blend is None:
        raise ConfigError("data.dynamic_data_selection: each domain's held-out samples come from its validation "
                          "range of data.splits_string; use data_prefix: [w1, path1, w2, path2, ...] or "
                          "data.datasets instead of the {train, validation, test} form")
    return [p for _, p in blend.blend]


def _read_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise ConfigError(f"{REFERENCE_LOSSES_KEY}: file not found: {path}")
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as stream:
                return json.load(stream)
        return OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:  # noqa: BLE001 - any parse error is the user's file
        raise ConfigError(f"{REFERENCE_LOSSES_KEY}: cannot read {path}: {' '.join(str(exc).split())}") from None


def _loss(value: Any, where: str) -> float:
    try:
        loss = float(value)
    except (TypeError, ValueError):
        loss = float("nan")
    if isinstance(value, bool) or not math.isfinite(loss) or loss < 0:
        raise ConfigError(f"{where}: a reference loss must be a finite number >= 0, got {value!r}")
    return loss


def reference_losses(value: Any, paths: Sequence[str]) -> list[float]:
    """One reference loss per domain, in blend order, from a list, a {domain: loss} mapping (domain = a
    path as written or its `domain_names` name) or a JSON/YAML file holding either."""
    where = REFERENCE_LOSSES_KEY
    if value is None:
        raise ConfigError(f"{REFERENCE_LOSSES_KEY}: required with data.dynamic_data_selection (one loss per "
                          f"domain: {', '.join(domain_names(paths))})")
    names = domain_names(paths)
    if isinstance(value, str) and value in REFERENCE_PRESETS:  # by SlimPajama domain, as data.prob_map
        where, preset = f"{REFERENCE_LOSSES_KEY} ({value})", REFERENCE_PRESETS[value]
        missing = [n for n in names if slimpajama_domain(n) not in preset]
        if missing:
            raise ConfigError(f"{where}: dataset '{missing[0]}' is not a SlimPajama domain (one of: "
                              f"{', '.join(SLIMPAJAMA_DOMAINS)})")
        return [preset[slimpajama_domain(n)] for n in names]
    if isinstance(value, str):
        where = f"{REFERENCE_LOSSES_KEY} ({value})"
        value = _read_file(value)
    if isinstance(value, Mapping):
        by_key = {str(k): v for k, v in value.items()}
        unknown = [k for k in by_key if k not in names and k not in paths]
        if unknown:
            raise ConfigError(f"{where}: unknown domain '{unknown[0]}' (domains: {', '.join(names)})")
        missing = [n for n, p in zip(names, paths) if n not in by_key and p not in by_key]
        if missing:
            raise ConfigError(f"{where}: no reference loss for domain '{missing[0]}' (domains: {', '.join(names)})")
        return [_loss(by_key[n] if n in by_key else by_key[p], f"{where}.{n}") for n, p in zip(names, paths)]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != len(paths):
            raise ConfigError(f"{where}: {len(value)} losses for {len(paths)} domains "
                              f"({', '.join(names)}); give one per domain, in blend order")
        return [_loss(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{where}: expected a list of losses, a {{domain: loss}} mapping or a file, got {value!r}")


def check_dynamic_selection(cfg: Any, kind: str | None) -> None:
    """The run-independent checks (validation, before any process starts). `kind`: the data kind."""
    data = cfg.data
    if data.dynamic_data_selection == "none":
        return
    if kind is None:
        raise ConfigError(NO_DATA_SOURCE)
    data_kind = kind
    if data_kind != "logical_shards":
        raise ConfigError(f"data.dynamic_data_selection={data.dynamic_data_selection}: needs a blend of "
                          f"domains (data.data_prefix or data.datasets); this config's data is '{data_kind}'")
    paths = domain_paths(data)
    if len(paths) < 2:
        raise ConfigError(f"data.dynamic_data_selection={data.dynamic_data_selection}: needs at least two "
                          f"domains in the blend, got {len(paths)}")
    reference_losses(data.dynamic_selection.reference_losses, paths)
