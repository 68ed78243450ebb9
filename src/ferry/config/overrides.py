"""The command line's Hydra overrides, checked before Hydra composes them, and the composition
itself (of a whole run, or of one group's preset) with every refusal as one `ConfigError` line.

Hydra accepts some overrides it then fails on with a traceback (a group given a number, `null`
or a list, a deleted group, an empty key) or merges silently (`offload=[a,b]`), and its lexer
refuses unquoted non-ASCII text (`run.dir=/data/ünïcødé`). Each is settled here: group values
must name one preset file of the group, deletions are allowed only of mapping entries, non-ASCII
values are quoted for Hydra, and keys whose entries no preset lists (`offload.tensors.*`,
`platform.xla_flags.*`, `platform.env.*`) are added without the `++` Hydra asks for.

A misspelt key or preset (`train.stpes=20`, `model=lama3_tiny`) is refused naming the nearest
known ones, not with Hydra's hint to append it with `+`.
"""

import difflib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ferry.config.train import register_train_defaults
from ferry.errors import ConfigError

# mappings whose entries a user names freely (validated later against the model or XLA)
OPEN_MAPPINGS = ("offload.tensors.", "platform.xla_flags.", "platform.host_offload_flags.", "platform.env.")


def nearest(word: str, known: Iterable[str], count: int = 1) -> list[str]:
    """The `count` known words closest to `word` (difflib's ratio, at least 0.6), closest first."""
    return difflib.get_close_matches(word, list(known), n=count, cutoff=0.6)


def did_you_mean(word: str, known: Iterable[str], count: int = 1) -> str:
    """`did you mean X?` (or `X or Y`) for a misspelt `word`; empty where nothing known is close."""
    close = nearest(word, known, count)
    return f"did you mean {' or '.join(close)}?" if close else ""


def group_presets(folder: Path) -> list[str]:
    """The presets of one config group (a folder of configs/): its YAML files' names, but for those
    starting with `_`, which hold keys the group's presets share through their defaults lists
    (configs/offload/_base.yaml) and are no preset to choose."""
    return sorted(p.stem for p in Path(folder).glob("*.yaml") if not p.stem.startswith("_"))


def config_groups(config_dir: Path) -> dict[str, list[str]]:
    """Each config group (a folder of configs/) and its presets' names."""
    return {folder.name: group_presets(folder) for folder in sorted(Path(config_dir).iterdir()) if folder.is_dir()}


def quote_non_ascii(argument: str) -> str:
    """`key=value` with a non-ASCII value quoted for Hydra's lexer (which takes non-ASCII
    text only inside quotes); other arguments as they are."""
    _, equals, value = argument.partition("=")
    if not equals or value.isascii():
        return argument
    return quoted_value(argument) or argument


def quoted_value(argument: str) -> str | None:
    """`key=value` with its plain value in quotes, for a value Hydra cannot read unquoted; None for
    a value that is a list, a mapping or quoted already (whose error is the user's to see)."""
    key, equals, value = argument.partition("=")
    if not equals or not value or value[0] in "[{'\"" or value.endswith("\\"):
        return None
    quote = next((q for q in ("'", '"') if q not in value), None)
    return None if quote is None else f"{key}={quote}{value}{quote}"


def open_mapping_entry(key: str) -> bool:
    return key.startswith(OPEN_MAPPINGS) and key.count(".") >= 2


def prepared_overrides(argv: list[str], config_dir: Path, allowed_groups: tuple[str, ...] | None = None) -> list[str]:
    """`argv` as Hydra should compose it: checked one by one (see the module's docstring), non-ASCII
    values quoted, entries of open mappings given `++`. `allowed_groups`: the top-level keys a
    command takes (None: every key)."""
    groups = config_groups(config_dir)
    parser = OverridesParser.create()
    out = []
    for argument in argv:
        if argument.startswith("-"):
            raise ConfigError(f"{argument}: ferry takes config overrides (key=value), not options")
        argument = quote_non_ascii(argument)
        try:
            (override,) = parser.parse_overrides([argument])
        except HydraException as error:
            quoted = quoted_value(argument)  # `data.eos_token=<|endoftext|>`: characters Hydra's grammar reserves
            try:
                (override,) = parser.parse_overrides([quoted or argument])
            except HydraException:
                raise ConfigError(
                    f"{argument}: not an override Hydra can read ({_one_line(error)}); a value with characters "
                    "such as < > | ( ) or spaces goes in quotes: key='value'"
                ) from error
            argument = quoted or argument
        key = override.key_or_group
        if not key:
            raise ConfigError(f"{argument}: an override needs a key before the '=' (e.g. train.steps=100)")
        top = key.split(".")[0]
        if allowed_groups is not None and top not in allowed_groups:
            raise ConfigError(
                f"{argument}: {key} is not a key of this command; it takes {', '.join(allowed_groups)} keys only"
            )
        if override.is_delete():
            if not open_mapping_entry(key):
                raise ConfigError(
                    f"{argument}: deleting {key} leaves the run without it; set another value instead (or null "
                    "where the key allows it)"
                )
        elif key in groups and override.package is None:
            _check_group_value(argument, key, override.value(), groups[key])
        if open_mapping_entry(key) and override.type.name == "CHANGE":
            argument = f"++{argument}"
        out.append(argument)
    return out


def _check_group_value(argument: str, group: str, value: Any, presets: list[str]) -> None:
    """A group override names exactly one preset of the group."""
    choose = f"choose one of configs/{group}/: {', '.join(presets)}"
    if isinstance(value, list):
        raise ConfigError(
            f"{argument}: {group} takes one preset; a list would merge them silently, key by key. {choose}"
        )
    if not isinstance(value, str) or not value:
        shown = "null" if value is None else repr(value)
        raise ConfigError(f"{argument}: {group} names a preset, not {shown}; {choose}")
    if value.startswith("_"):
        raise ConfigError(
            f"{argument}: a configs/{group}/ file whose name starts with _ holds keys the presets share and is not "
            f"a preset; {choose}"
        )
    if value not in presets:
        guess = did_you_mean(value, presets, count=3)
        raise ConfigError(
            f"{argument}: there is no configs/{group}/{value}.yaml; "
            + (f"{guess} (configs/{group}/ holds {', '.join(presets)})" if guess else choose)
        )


def hydra_compose(config_dir: Path, config_name: str, overrides: list[str]) -> Any:  # an omegaconf DictConfig
    """Hydra's composition of `config_name` from `config_dir`, unchecked: `train.*`'s defaults are
    registered first (from `TrainConfig`, their one source), here rather than on import."""
    register_train_defaults()
    with initialize_config_dir(str(config_dir), version_base=None):
        return compose(config_name, overrides=overrides)


def compose_node(
    config_name: str, argv: list[str], config_dir: Path, allowed_groups: tuple[str, ...] | None = None
) -> dict:
    """The resolved config `config_name` with these overrides, as a plain dict; every refusal
    (ferry's checks above, then Hydra's and OmegaConf's) a one-line ConfigError."""
    overrides = prepared_overrides(argv, config_dir, allowed_groups)
    try:
        return _resolved(config_dir, config_name, overrides)
    except ConfigError:
        check_keys(config_dir, config_name, overrides)  # a misspelt key: its nearest known key, not Hydra's hint
        raise


def check_keys(config_dir: Path, config_name: str, overrides: list[str]) -> None:
    """Refuse an override that changes a key the config does not have (Hydra would ask to append
    it with `+`), naming the nearest known key. The known keys are those of the config composed
    with the overrides' preset choices alone; anything else is left to Hydra's own message."""
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    groups = config_groups(config_dir)
    choices = [text for text, o in zip(overrides, parsed, strict=True) if o.key_or_group in groups and not o.package]
    try:
        known = set(dotted_keys(OmegaConf.to_container(hydra_compose(config_dir, config_name, choices))))
    except (HydraException, OmegaConfBaseException, ValueError, TypeError):
        return
    for override in parsed:
        key = override.key_or_group
        if override.type.name != "CHANGE" or key in groups or key in known or open_mapping_entry(key):
            continue
        raise ConfigError(unknown_key(key, known))


def unknown_key(key: str, known: set[str]) -> str:
    """The refusal of `key`: the nearest key of the same mapping (or, where the mapping itself is
    misspelt, the nearest key as deep), else the mapping's keys."""
    parent, _, name = key.rpartition(".")
    siblings = sorted(k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent)
    if parent in known or not parent:
        close = nearest(name, siblings)
        guess = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    else:
        guess = did_you_mean(key, [k for k in known if k.count(".") == key.count(".")])
    if not guess and siblings:
        guess = f"{parent or 'the config'} has the keys {', '.join(siblings)}"
    return f"unknown key {key}: {guess}" if guess else f"unknown key {key}"


def dotted_keys(node: object, prefix: str = "") -> Iterator[str]:
    """Every key of a nested mapping as a dotted path (`train`, `train.steps`, ...)."""
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}{key}"
            yield path
            yield from dotted_keys(value, f"{path}.")


def preset_node(config_dir: Path, group: str, name: str) -> dict:
    """One preset of `group` as a run composes it, with the keys it takes from its defaults list
    (configs/offload/_base.yaml), as a plain dict: what `offload=NAME` puts under `offload`."""
    if name not in group_presets(Path(config_dir) / group):
        raise ConfigError(f"there is no {group} preset {name!r} in configs/{group}/")
    node = _resolved(config_dir, f"{group}/{name}", []).get(group)
    if not isinstance(node, dict):
        raise ConfigError(f"configs/{group}/{name}.yaml holds no keys")
    return node


def _resolved(config_dir: Path, config_name: str, overrides: list[str]) -> dict:
    """Hydra's composition, resolved, as a plain dict; its refusals one-line ConfigErrors."""
    try:
        cfg = hydra_compose(config_dir, config_name, overrides)
        node = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as error:
        reasons = [_one_line(error)] + ([_one_line(error.__cause__)] if error.__cause__ is not None else [])
        text = " ".join(reason for reason in reasons if reason)
        text = text.split(" Config search path:")[0]  # Hydra's search path says nothing to fix
        raise ConfigError(text or type(error).__name__) from error
    assert isinstance(node, dict)
    return node


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
