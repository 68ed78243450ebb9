"""Equinox's abstract/final pattern, enforced rather than claimed. Equinox 0.13 accepts
`strict=True` and checks nothing, so ferry marks each final class with `typing.final` (mypy then
refuses a subclass of it, or an override of its methods) and its abstract bases call
`refuse_final_bases` from `__init_subclass__`, so a subclass of a final class fails where it is
defined, at run time too."""


def refuse_final_bases(cls: type) -> None:
    """Raise TypeError if `cls` subclasses a final (`typing.final`) class."""
    final = [base.__name__ for base in cls.__mro__[1:] if base.__dict__.get("__final__", False)]
    if final:
        raise TypeError(
            f"{cls.__name__} subclasses {final[0]}, a final class; subclass its abstract base instead "
            "(Equinox's abstract/final pattern)"
        )
