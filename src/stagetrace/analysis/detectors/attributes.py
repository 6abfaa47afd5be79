"""Settings of the divergent stage (and its resource) that differ from the baseline's, weighed by contrast."""

from __future__ import annotations

from stagetrace.analysis.causes import Cause, attribute_causes
from stagetrace.analysis.detectors import Case, register


@register
class AttributeContrast:
    name = "attributes"

    def detect(self, case: Case) -> list[Cause]:
        return attribute_causes(case.stage, case.span, case.baseline_span, case.contrast)
