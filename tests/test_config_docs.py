"""Field docstrings read from the config dataclasses' source, and what a field's checks allow."""

from dataclasses import dataclass

from hfl.config import FLConfig
from hfl.config_docs import allowed_values, describe, field_docs
from hfl.errors import check, check_choice
from hfl.methods.heterofl import HeteroFLConfig


@dataclass(frozen=True)
class Example:
    mode: str = "a"
    """How to go."""
    count: int = 1
    """How many:
        at least one."""
    ratio: float = 0.5
    label: str = ""
    """Any text."""
    rates: tuple[float, ...] = (1.0,)
    """Rates."""
    flag: bool = False

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ("a", "b"))
        check(self.count >= 1, "count", self.count, "an integer >= 1")
        check(0 < self.ratio < 1, "ratio", self.ratio, "a number in (0, 1)")
        check(bool(self.rates) and all(0 < r <= 1 for r in self.rates), "rates", list(self.rates), "rates in (0, 1]")


def test_field_docs_are_the_strings_under_each_field():
    assert field_docs(Example) == {"mode": "How to go.", "count": "How many:\nat least one.", "label": "Any text.", "rates": "Rates."}


def test_field_docs_include_inherited_fields_and_a_subclass_overrides_them():
    docs = field_docs(HeteroFLConfig)
    assert docs["tier_window"].startswith("-1: each client trains the largest level fitting its budget")  # LadderConfig's
    assert docs["weighting"].startswith("The paper and the authors' code average every entry")  # HeteroFL's own, not MethodConfig's
    assert docs["widths"] == "Width rates a client may train, relative to the global model (the paper's a-e levels)."


def test_allowed_values_are_what_each_fields_check_says():
    assert allowed_values(Example) == {"mode": "one of a, b", "count": "an integer >= 1", "ratio": "a number in (0, 1)",
                                       "rates": "rates in (0, 1]"}


def test_describe_writes_docs_as_comments_and_names_a_changed_default():
    lines = describe(Example(count=3, label="a: b"), allowed=True)
    assert lines == ["# How to go.", "# allowed: one of a, b", "mode: a",
                     "# How many:", "# at least one.", "# allowed: an integer >= 1", "count: 3  # default: 1",
                     "# allowed: a number in (0, 1)", "ratio: 0.5",
                     "# Any text.", "label: 'a: b'  # default: ''",
                     "# Rates.", "# allowed: rates in (0, 1]", "rates: [1.0]",
                     "flag: false"]
    assert describe(FLConfig())[:2] == ["# Communication rounds.", "rounds: 20"]


def test_model_norm_auto_names_every_method_that_chooses_another_norm_than_bn():
    from hfl.config import ModelConfig
    from hfl.registry import METHODS

    doc = field_docs(ModelConfig)["norm"].lower()
    for name in METHODS.names():
        norm = METHODS.get(name).preferred_norm
        assert norm == "bn" or (name in doc and norm in doc), (name, norm)
