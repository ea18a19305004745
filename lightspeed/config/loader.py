"""`load()`: from a dict, file or JSON string to a validated `LightspeedConfig`, with every problem
reported at once.

Order: parse (hjson) -> sort top-level keys (known / typo / unknown) -> drop the "auto"s DeepSpeed
itself accepts, reject the other Hugging Face "auto" placeholders -> map legacy names -> validate
sections -> cross-section rules -> resolve the batch triad -> check support. Must not build anything from the config.

Note: "auto"
    DeepSpeed's pydantic config sections (DeepSpeedConfigModel, built non-strict) drop a key whose
    value is "auto" before validating, so the key takes DeepSpeed's default: a config straight from
    a Hugging Face template (as TRL passes for its ZeRO-3 reference model) initializes. That holds
    only for the keys directly inside `zero_optimization`, `tensor_parallel`, `comms_logger`,
    `hybrid_engine` and `timers.throughput` (`AUTO_AS_DEFAULT_SECTIONS`); lightspeed does the same
    there, and logs each key defaulted. Everywhere else DeepSpeed reads "auto" as a value and fails
    later (a string compared with a number for the batch triad or `gradient_clipping`; a truthy
    `fp16.enabled`), so lightspeed refuses it with every path named; `pipeline.stages` and
    `expert_parallel.*` are DeepSpeed's own "auto" values. `validate(hf_placeholders=True)` (for
    `lightspeed config check` on a template) drops every remaining "auto" too and skips the batch
    triad when one of its members was "auto", so the template's other problems show.

Note: unknown top-level keys
    DeepSpeed ignores unknown top-level keys silently, so a misspelt section is simply lost.
    Here an unknown top-level key is an error when it is likely a typo of a known key, and a
    logged warning otherwise. "Likely a typo" means: after lower-casing and reading "-" as "_" it
    equals a known key, or it is within Damerau-Levenshtein distance 1 (keys of up to 8
    characters) or 2 (longer keys) of one. That catches ``train_batch_sz``, ``zero_optimisation``,
    ``Bf16``, ``fp61`` and lets other projects' keys through with a warning, e.g. LLaMA-Factory's
    ``comms_config`` (5 edits from ``comms_logger``) and ``monitor_config``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import ValidationError

from lightspeed._utils.logging import get_logger
from lightspeed.config.base import as_int, dotted, problems_from, section_at, show
from lightspeed.config.batch import BATCH_KEYS, detect_world_size, resolve_batch
from lightspeed.config.elasticity import ElasticityError, elastic_batch
from lightspeed.config.errors import ConfigError
from lightspeed.config.legacy import map_legacy
from lightspeed.config.model import LightspeedConfig, cross_problems
from lightspeed.config.parse import read_source
from lightspeed.config.support import raise_unimplemented, unimplemented_features

logger = get_logger(__name__)

# Top-level names DeepSpeed reads that legacy.py consumes (they are not fields of the model).
LEGACY_TOP_LEVEL = ("bfloat16", "allgather_size")

# Names people write for a top-level key that are too far from it for the typo rule.
# DeepSpeed before 0.17 read the sequence-parallel dtype as seq_parallel_comm_data_type; 0.19.8 ignores that name.
MISNAMED_TOP_LEVEL = {"seq_parallel_comm_data_type": "seq_parallel_communication_data_type"}

# Places where DeepSpeed itself gives "auto" a meaning, so it is not an unresolved HF placeholder.
AUTO_ALLOWED_PATHS = ("pipeline.stages", "data_types.keep_in_fp32_modules", "zero_optimization.zenflow.select_strategy",
                      "zero_optimization.zenflow.select_interval", "zero_optimization.zenflow.update_interval")
AUTO_ALLOWED_PREFIXES = ("expert_parallel.",)
# Sections whose own keys DeepSpeed drops when "auto" (Note: "auto").
AUTO_AS_DEFAULT_SECTIONS = (("zero_optimization",), ("tensor_parallel",), ("comms_logger",), ("hybrid_engine",),
                            ("timers", "throughput"))


def _osa_distance(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (optimal string alignment: adjacent transpositions count 1)."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[len(b)]


def likely_typo(key: str, known: list[str]) -> Optional[str]:
    """The known key `key` is probably a misspelling of, or None (rule in the module Note)."""
    normalized = key.lower().replace("-", "_")
    limit = 1 if len(key) <= 8 else 2
    best, best_distance = None, limit + 1
    for candidate in known:
        distance = 0 if normalized == candidate else _osa_distance(normalized, candidate)
        if distance < best_distance:
            best, best_distance = candidate, distance
    return best


def _section_owning(key: str) -> Optional[str]:
    """The one top-level section that has `key` as one of its own keys (for a misplaced-key hint)."""
    owners = [
        name
        for name in LightspeedConfig.model_fields
        if (section := section_at(LightspeedConfig, (name,))) is not None and key in section.model_fields
    ]
    return owners[0] if len(owners) == 1 else None


def _top_level(parsed: dict) -> tuple[list[str], list[str]]:
    """(problems for typo keys, unknown keys to ignore); warnings are logged for the latter."""
    known = list(LightspeedConfig.model_fields) + list(LEGACY_TOP_LEVEL)
    problems, ignored = [], []
    for key in parsed:
        if key in known:
            continue
        typo = MISNAMED_TOP_LEVEL.get(key) or likely_typo(key, known)
        if typo is not None:
            problems.append(f'{key}: unknown top-level key; did you mean "{typo}"?')
            continue
        ignored.append(key)
        owner = _section_owning(key)
        hint = f'; "{key}" is a key of {owner}, did you mean {owner}.{key}?' if owner else ""
        logger.warning(f"config: unknown top-level key {show(key)} is ignored (not a DeepSpeed key{hint})")
    return problems, ignored


def _auto_paths(value: Any, loc: tuple = ()) -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _auto_paths(v, loc + (k,))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _auto_paths(v, loc + (i,))]
    if value == "auto":
        path = dotted(loc)
        if path not in AUTO_ALLOWED_PATHS and not path.startswith(AUTO_ALLOWED_PREFIXES):
            return [path]
    return []


def _without_keys(parsed: dict, paths: list[tuple]) -> dict:
    """`parsed` less the keys at `paths` (copying only the dicts on the way to them)."""
    out = dict(parsed)
    for path in paths:
        node = out
        for key in path[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        del node[path[-1]]
    return out


def _deepspeed_autos(parsed: dict) -> list[tuple]:
    """The paths of the "auto" keys DeepSpeed drops (Note: "auto")."""
    found = []
    for section in AUTO_AS_DEFAULT_SECTIONS:
        node: Any = parsed
        for key in section:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            found += [section + (key,) for key, value in node.items() if value == "auto"]
    return found


def _placeholder_autos(value: Any, loc: tuple = ()) -> list[tuple]:
    """The paths of every "auto" dict value but DeepSpeed's own (for `hf_placeholders`)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _placeholder_autos(v, loc + (k,))]
    if isinstance(value, list) and "auto" in value:  # e.g. "betas": ["auto", 0.999]: the whole key
        value = "auto"
    if value == "auto" and loc and isinstance(loc[-1], str) and dotted(loc) not in AUTO_ALLOWED_PATHS \
            and not dotted(loc).startswith(AUTO_ALLOWED_PREFIXES):
        return [loc]
    return []


def _auto_problems(parsed: dict, ignored: list[str]) -> list[str]:
    paths = _auto_paths({k: v for k, v in parsed.items() if k not in ignored})
    if not paths:
        return []
    return [
        '"auto" is a Hugging Face placeholder, not a value: the caller (e.g. the HF Trainer or '
        'Accelerate) must resolve every "auto" before passing the config; found at:'
    ] + [f'{path}: must be a concrete value (got "auto")' for path in paths]


def _warn_like_deepspeed(cfg: LightspeedConfig) -> None:
    """The warnings DeepSpeedConfig._do_warning_check gives."""
    if cfg.vocabulary_size is not None and cfg.vocabulary_size % 8:
        logger.warning(f"config: vocabulary_size {cfg.vocabulary_size} is not a multiple of 8 (slower tensor cores)")
    max_grad_norm = cfg.optimizer.params.get("max_grad_norm") if cfg.optimizer is not None else None
    if isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool) and max_grad_norm > 0:
        logger.warning(
            f"config: optimizer.params.max_grad_norm ({max_grad_norm}) is not applied by the engine; "
            "use the top-level gradient_clipping"
        )


def _batch_inputs(mapped: dict) -> Optional[tuple]:
    """The given triad values as ints (None where absent), or None when one of them is invalid
    (its own validation problem is reported instead)."""
    out = []
    for key in BATCH_KEYS:
        value = mapped.get(key)
        if value is None:
            out.append(None)
            continue
        count = as_int(value)
        if count is None or count < 1:
            return None
        out.append(count)
    return tuple(out)


def _validate(model_input: dict) -> tuple[Optional[LightspeedConfig], Optional[LightspeedConfig], list[str]]:
    """(the config or None if any section is invalid, the config of the valid sections with the
    invalid ones at their defaults, the problems). Cross-section rules still run when some sections
    are invalid: over the valid ones, keeping only the rules that do not mention an invalid section."""
    try:
        cfg = LightspeedConfig.model_validate(model_input)
    except ValidationError as err:
        problems = _dedupe(problems_from(err, LightspeedConfig))
        failed = {str(e["loc"][0]) for e in err.errors() if e["loc"]}
        try:
            partial = LightspeedConfig.model_validate({k: v for k, v in model_input.items() if k not in failed})
        except ValidationError:  # pragma: no cover - every failing section was removed
            return None, None, problems
        for line in cross_problems(partial):
            if not any(line.startswith(key) or f" {key}." in line or f" {key} " in line for key in failed):
                problems.append(line)
        return None, partial, problems
    return cfg, cfg, cross_problems(cfg)


@dataclass
class Validation:
    """What `validate` found: `config` (None when there are problems), every problem, the settings the
    config turns on that lightspeed does not implement yet, and `valid_sections`: the config with its
    invalid sections at their defaults (None when it could not be read at all), from which the
    unimplemented settings are listed even when other sections have problems."""

    config: Optional[LightspeedConfig]
    problems: list[str] = field(default_factory=list)
    unimplemented: list[str] = field(default_factory=list)
    valid_sections: Optional[LightspeedConfig] = None
    placeholders: list[str] = field(default_factory=list)  # the "auto"s `hf_placeholders` set aside
    error_type: type = ConfigError  # elasticity's problems raise its own error classes, as DeepSpeed's do

    def raise_for_errors(self, check_support: bool = True) -> LightspeedConfig:
        """The config; ConfigError listing every problem, then NotImplementedError (when `check_support`)."""
        if self.problems:
            raise self.error_type(self.problems)
        if check_support:
            raise_unimplemented(self.unimplemented)
        assert self.config is not None
        return self.config


def validate(source: Union[dict, str, "os.PathLike[str]", LightspeedConfig],
             world_size: Optional[int] = None, hf_placeholders: bool = False) -> Validation:
    """Validate a ds_config and resolve its batch triad, collecting every problem instead of raising
    (arguments as `load`). `hf_placeholders`: read every "auto" as a Hugging Face placeholder to be
    filled in later (Note: "auto"), listed in `.placeholders`; the config is then checked, not usable."""
    if isinstance(source, LightspeedConfig):
        if world_size is None or as_int(world_size) == source.world_size:
            return Validation(source, [], unimplemented_features(source), source)
        found = validate(source.raw, world_size)
        if found.config is not None:
            found.config._source = source.source
        return found

    try:
        parsed, name = read_source(source)
    except ConfigError as err:
        return Validation(None, list(err.problems))
    problems, ignored = _top_level(parsed)
    defaulted = _deepspeed_autos(parsed)
    for path in defaulted:
        logger.info(f'config: {dotted(path)} is "auto": DeepSpeed\'s default applies')
    parsed = _without_keys(parsed, defaulted)
    placeholders: list[tuple] = []
    if hf_placeholders:
        placeholders = _placeholder_autos({k: v for k, v in parsed.items() if k not in ignored})
        parsed = _without_keys(parsed, placeholders)
    autos = _auto_problems(parsed, ignored)
    if autos:
        return Validation(None, problems + autos)

    mapped, legacy_problems = map_legacy(parsed)
    problems += legacy_problems
    if "allgather_size" in mapped:
        logger.warning("config: allgather_size is ignored (it is only read with a boolean zero_optimization)")

    cfg, partial, section_problems = _validate({k: v for k, v in mapped.items() if k in LightspeedConfig.model_fields})
    problems += section_problems
    unimplemented = unimplemented_features(partial) if partial is not None else []

    resolved = None
    try:
        world, world_source = detect_world_size(world_size)
    except ConfigError as err:
        problems += err.problems
        world, world_source = None, ""
    elasticity = mapped.get("elasticity")
    elastic = isinstance(elasticity, dict) and elasticity.get("enabled") is True  # it sets the triad itself
    given = _batch_inputs(mapped)
    batch_placeholder = any(path[0] in BATCH_KEYS for path in placeholders)
    error_type: type = ConfigError
    if world is not None and given is not None and not elastic and not batch_placeholder:
        *resolved, batch_problems = resolve_batch(*given, world, world_source)
        problems += batch_problems
    elif world is not None and elastic and not hf_placeholders:
        try:
            resolved = list(elastic_batch(mapped, world))
        except (ElasticityError, ValueError) as err:
            problems.append(str(err))
            error_type = type(err) if isinstance(err, ElasticityError) else ElasticityError
        else:
            for key, value in zip(BATCH_KEYS, resolved):
                if key in mapped:
                    logger.warning(f"elasticity: overriding {key} {mapped[key]} -> {value}")
            logger.info(f"elasticity: batch {resolved[0]} = micro {resolved[1]} x accumulation {resolved[2]} x "
                        f"world size {world}")

    shown = [dotted(path) for path in placeholders]
    if problems or hf_placeholders:  # a template with its placeholders set aside is checked, never used
        return Validation(None, problems, unimplemented, partial, shown, error_type)
    assert cfg is not None
    _warn_like_deepspeed(cfg)
    if resolved is not None:
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = resolved
    cfg._raw = mapped
    cfg._world_size, cfg._world_size_source, cfg._source = world, world_source, name
    return Validation(cfg, [], unimplemented, cfg)


def load(
    source: Union[dict, str, "os.PathLike[str]", LightspeedConfig],
    world_size: Optional[int] = None,
    *,
    check_support: bool = True,
) -> LightspeedConfig:
    """Validate a ds_config and resolve its batch triad.

    source: a dict, a path to a JSON/HJSON file, a JSON string (first non-blank character ``{``),
        or an already loaded `LightspeedConfig` (returned as is, or re-resolved for a new world size).
    world_size: the data-parallel world size; by default the initialized torch.distributed world
        size, else env WORLD_SIZE, else 1.
    check_support: raise NotImplementedError for settings lightspeed does not implement yet.

    Raises ConfigError listing every problem found, then NotImplementedError (see `support.py`).
    """
    return validate(source, world_size).raise_for_errors(check_support)


def _dedupe(lines: list[str]) -> list[str]:
    seen: set[str] = set()
    return [line for line in lines if not (line in seen or seen.add(line))]
