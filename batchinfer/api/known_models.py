"""Which model names a tenant may give a batch, and which may appear as a metrics label.

A batch's `model` is tenant text. It is accepted when it is the default model, a model a live worker
serves (store.workers.served_models), or one of the `allowed_models` setting; while no worker is live and
no allow-list is set, any name is accepted (its shards wait for a worker of that model, as line_models.py
does for a line's body.model). Metrics label a model by its name only when it is known this way, else
OTHER_LABEL: a tenant cannot create series, read another tenant's model names, or make the API probe a path.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store.line_models import MODEL_NOT_FOUND
from batchinfer.store.workers import served_models

OTHER_LABEL = "other"  # the metrics label of a model that is not known (see the module docstring)


class UnknownModel(ValueError):
    """A batch names a model nobody serves and the operator did not allow (the API answers 400)."""

    code = MODEL_NOT_FOUND

    def __init__(self, model: str, known: frozenset[str]) -> None:
        names = ", ".join(sorted(known))
        super().__init__(f"model {model[:64]!r} is not served here; use one of: {names} (operators add "
                         "names with the allowed_models setting)")
        self.model = model


def known_models(session: Session, settings: Settings) -> frozenset[str]:
    """The default model, the allow-list and the models live workers serve."""
    return frozenset({settings.default_model, *settings.allowed_models, *served_models(session)})


def check_batch_model(session: Session, *, model: str, settings: Settings) -> None:
    """UnknownModel unless `model` is known, or nothing restricts it (no live worker, no allow-list)."""
    if model == settings.default_model or model in settings.allowed_models:
        return
    served = served_models(session)
    if model in served or (not served and not settings.allowed_models):
        return
    raise UnknownModel(model, frozenset({settings.default_model, *settings.allowed_models, *served}))


def model_label(model: str, known: frozenset[str]) -> str:
    """A model's metrics label: its name when known, else OTHER_LABEL (never a path, never tenant text)."""
    return model if model in known else OTHER_LABEL
