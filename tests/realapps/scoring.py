"""Scoring a merged report against the injected ground truth.

A finding (report["stragglers"][i]) *locates* the fault when it names the injected node (finding
["node"]) or, for a finding without a node, when its ranks hold the injected world rank. It is a true
positive when it locates the fault and its cause is the injected one. Per (app, fault):

- precision: true positives / findings, over the fault runs (None without findings);
- recall: fault runs with at least one true positive / fault runs;
- cause_accuracy: findings that locate the fault with the right cause / findings that locate it
  (None when none locates it);
- findings_on_balanced: findings on the balanced runs (every one is false);
- runs_fault_without_effect: fault runs whose injector measured no effect (ground truth
  "fault_effect", the co-runner's: it took no CPU from the rank), left out of the three ratios: a
  run the fault did not touch tests nothing. Recordings made before the injector measured keep
  being scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunScore:
    app: str
    fault: str
    run: str
    findings: int = 0
    located: int = 0
    true_positive: int = 0
    balanced: bool = False
    merge_status: str = ""
    error: str = ""
    without_effect: bool = False  # the injector measured that its fault took nothing from the rank
    details: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def locates(finding: dict[str, Any], truth: dict[str, Any]) -> bool:
    node = finding.get("node")
    if node:
        return node == truth.get("node")
    rank = truth.get("rank")
    return rank is not None and rank in (finding.get("ranks") or [])


def score_run(report: dict[str, Any], truth: dict[str, Any], run: str) -> RunScore:
    findings = list(report.get("stragglers") or [])
    s = RunScore(app=truth["app"], fault=truth["fault"], run=run, findings=len(findings),
                 balanced=truth.get("cause") is None, merge_status=str(report.get("status", "")),
                 without_effect=not (truth.get("fault_effect") or {}).get("took_effect", True))
    for f in findings:
        loc = not s.balanced and locates(f, truth)
        tp = loc and f.get("cause") == truth.get("cause")
        s.located += int(loc)
        s.true_positive += int(tp)
        s.details.append({"node": f.get("node"), "ranks": f.get("ranks"), "cause": f.get("cause"),
                          "comm_id": f.get("comm_id"), "located": loc, "true_positive": tp})
    return s


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def aggregate(scores: list[RunScore], app: str, fault: str) -> dict[str, Any]:
    """The bench line of one (app, fault) (app or fault may be 'all' for the totals)."""
    ok = [s for s in scores if not s.error and not s.without_effect]
    faulty = [s for s in ok if not s.balanced]
    balanced = [s for s in ok if s.balanced]
    findings = sum(s.findings for s in faulty)
    located = sum(s.located for s in faulty)
    tp = sum(s.true_positive for s in faulty)
    return {
        "bench": "real_diagnosis", "app": app, "fault": fault, "runs": len(ok),
        "failed_runs": sum(1 for s in scores if s.error),
        "runs_fault_without_effect": sum(1 for s in scores if not s.error and s.without_effect),
        "precision": _ratio(tp, findings),
        "recall": _ratio(sum(1 for s in faulty if s.true_positive > 0), len(faulty)),
        "cause_accuracy": _ratio(tp, located),
        "findings_on_balanced": sum(s.findings for s in balanced) if balanced else None,
    }
