"""Check an exported graph against reference outputs: ONNX Runtime directly and through Polygraphy.

Both are run on the same feeds. The direct ONNX Runtime run gives the recorded ``max_abs_err``;
Polygraphy's ``Comparator`` (an ``OnnxrtRunner`` against the reference as a pre-recorded runner)
gives an independent pass/fail under the same tolerances, the check ``polygraphy run`` would do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Comparison:
    """Result of comparing a graph's outputs to a reference over several feeds."""

    max_abs_err: float
    atol: float
    rtol: float
    passed: bool
    polygraphy_passed: bool
    per_case: list[float] = field(default_factory=list)

    def as_metrics(self) -> dict:
        return {
            "max_abs_err": self.max_abs_err,
            "atol": self.atol,
            "rtol": self.rtol,
            "passed": self.passed,
            "polygraphy_passed": self.polygraphy_passed,
            "per_case_max_abs_err": self.per_case,
        }


def ort_session(onnx_path: str | Path):
    """A CPU ONNX Runtime session (CUDA first when onnxruntime-gpu offers it)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    return ort.InferenceSession(str(onnx_path), providers=providers)


def compare_onnx(
    onnx_path: str | Path,
    feeds: Sequence[dict[str, np.ndarray]],
    reference: Sequence[dict[str, np.ndarray]],
    atol: float,
    rtol: float,
) -> Comparison:
    """Run ``onnx_path`` on each feed and compare every output with ``reference`` (same order, same names).

    ``passed`` means ``|ort - ref| <= atol + rtol·|ref|`` elementwise for every output of every feed.
    """
    session = ort_session(onnx_path)
    per_case: list[float] = []
    passed = True
    for feed, ref in zip(feeds, reference, strict=True):
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
        case_err = 0.0
        for name, expected in ref.items():
            got = outputs[name]
            if got.shape != expected.shape:
                raise ValueError(
                    f"{name}: ONNX Runtime shape {got.shape} != reference shape {expected.shape}"
                )
            diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
            case_err = max(case_err, float(diff.max(initial=0.0)))
            passed &= bool(np.all(diff <= atol + rtol * np.abs(expected.astype(np.float64))))
        per_case.append(case_err)
    poly = polygraphy_compare(onnx_path, feeds, reference, atol, rtol)
    return Comparison(max(per_case, default=0.0), atol, rtol, passed, poly, per_case)


def polygraphy_compare(
    onnx_path: str | Path,
    feeds: Sequence[dict[str, np.ndarray]],
    reference: Sequence[dict[str, np.ndarray]],
    atol: float,
    rtol: float,
    runner: object | None = None,
) -> bool:
    """Polygraphy ``Comparator``: the reference outputs vs ``runner`` (default: ``OnnxrtRunner``)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, RunResults, SimpleCompareFunc
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.logger import G_LOGGER

    if runner is None:
        runner = OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=["CPUExecutionProvider"]))
    # Relative errors divide by the reference; exact zeros there are expected, not worth a warning.
    with G_LOGGER.verbosity(G_LOGGER.ERROR), np.errstate(divide="ignore", invalid="ignore"):
        results = Comparator.run([runner], data_loader=list(feeds))
        recorded = RunResults()
        recorded.append(
            ("pytorch", [IterationResult(outputs=dict(ref), runner_name="pytorch") for ref in reference])
        )
        recorded.extend(results)
        accuracy = Comparator.compare_accuracy(
            recorded, compare_func=SimpleCompareFunc(atol=atol, rtol=rtol, check_shapes=True)
        )
    return bool(accuracy)
