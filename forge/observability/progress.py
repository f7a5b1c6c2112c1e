"""A tqdm progress bar for a run: steps done / total, with a couple of live metrics."""

from collections.abc import Mapping, Sequence
from typing import TextIO

from tqdm import tqdm

# Keys whose last component does not say whose figure it is: their names on the console say
# what they count.
NAMES = {
    "train/tokens_per_s": "trained tok/s",
    "generator/tokens_per_s": "generated tok/s",
    "teacher/tokens_per_s": "teacher-scored tok/s",
}


def short_names(keys: Sequence[str]) -> dict[str, str]:
    """Each key's name on the console: its NAMES entry, else its last "/" component unless two
    keys share that (train/loss and eval/loss), then the whole key."""
    last = [key.rsplit("/", 1)[-1] for key in keys]
    return {
        key: NAMES.get(key, name if last.count(name) == 1 else key)
        for key, name in zip(keys, last, strict=True)
    }


class ProgressBar:
    """Shows the last logged step out of the total, and the first two of `keys` present.

    Two numbers fit next to the bar on any terminal; every metric is in the files anyway.
    It has the `Backend` methods, so `MetricLogger` can drive it like any other backend.
    """

    def __init__(
        self,
        total: int,
        keys: Sequence[str] = (),
        desc: str = "steps",
        file: TextIO | None = None,
        disable: bool | None = False,
    ) -> None:
        """`disable=None` hides the bar when `file` is not a terminal (tqdm's rule)."""
        self.keys = tuple(keys)
        self.names = short_names(self.keys)
        self._bar = tqdm(total=total, desc=desc, file=file, disable=disable, dynamic_ncols=True)

    @property
    def n(self) -> int:
        """Steps logged so far."""
        return self._bar.n

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float = 0.0) -> None:
        shown = {self.names[k]: metrics[k] for k in self.keys if k in metrics}
        postfix = {name: f"{value:.4g}" for name, value in list(shown.items())[:2]}
        self._bar.set_postfix({"step": step, **postfix}, refresh=False)
        self._bar.update(step - self._bar.n)  # a resumed run starts further on

    def log_eval(self, step: int, metrics: Mapping[str, float], wall_time: float = 0.0) -> None:
        """Evals have lines of their own (ConsoleBackend); the bar counts steps."""

    def close(self) -> None:
        self._bar.close()
