"""The preset a command without `offload=` trained with before that became a choice
(`ferry.run.default_policy`): the tests written against it keep it, pinned here;
tests/run/test_default_policy.py tests the choice itself."""

OLD_DEFAULT = "offload=minimal_offloaded"


def with_old_default(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """The overrides, with offload=minimal_offloaded added where they name no preset."""
    named = any(o.split("=", 1)[0].lstrip("+~") == "offload" for o in overrides)
    return overrides if named else (*overrides, OLD_DEFAULT)
