"""A "training loop" annotated with NVIDIA's `nvtx` package, for tests/test_nvtx.py: it does not
know about gpuprof; NVTX_INJECTION64_PATH alone decides whether its ranges are recorded.
Usage: python nvtx_train.py STEPS [LINGER_S]   (linger: stay alive that long at the end, so the
collector's process tracker, which scans once a second, sees a process this short)"""

import sys
import time

import nvtx


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@nvtx.annotate("optimizer", color="red", domain="train")
def optimizer_step() -> None:
    busy(0.001)


def main() -> None:
    steps = int(sys.argv[1])
    for step in range(steps):
        with nvtx.annotate("step", domain="train", category=3):
            with nvtx.annotate("forward", color="green", domain="train"):
                busy(0.002)
            nvtx.push_range("backward", domain="train")
            busy(0.003)
            nvtx.pop_range(domain="train")
            optimizer_step()
    rng = nvtx.start_range("evaluation")  # the default domain, ended below
    busy(0.001)
    nvtx.end_range(rng)
    with nvtx.annotate("<phase name='x&y'>\u00fcber " + "long " * 100, domain="train"):
        pass
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
    print("enabled", nvtx.enabled(), flush=True)


if __name__ == "__main__":
    main()
