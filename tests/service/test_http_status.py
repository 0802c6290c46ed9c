"""The one table from library errors to HTTP statuses (`reshard.service.http_errors`): each class answers
the status it always did, a subclass not in the table answers its nearest listed base's, and
`reshard.errors` itself knows nothing of HTTP."""

from __future__ import annotations

import inspect
import json

import pytest

import reshard.errors as errors
from reshard.errors import PlanError, ReshardError, StoreError
from reshard.service.http_errors import response_for, status_for

pytestmark = pytest.mark.pure

EXPECTED = {
    "ReshardError": 400, "HeaderError": 422, "CheckpointError": 422, "ManifestError": 422, "RegistryError": 422,
    "PlanError": 422, "BoxError": 400, "SourceChangedError": 409, "IntegrityError": 502, "NotFoundError": 404, "OutputError": 507,
    "NoSpaceError": 507, "QuotaError": 507, "ReadOnlyError": 503, "OutputPermissionError": 503,
    "OutputPathError": 409, "OutputIOError": 503, "StateUnavailableError": 503, "StateFullError": 507,
    "PeerFailedError": 503, "StoreError": 502, "StoreUnavailableError": 503,
    "TpMismatchError": 422, "MissingDependencyError": 503,
}


def test_every_library_error_has_its_status() -> None:
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, ReshardError)}
    assert set(classes) == set(EXPECTED)
    assert {n: status_for(c("x")) for n, c in classes.items()} == EXPECTED


def test_a_subclass_answers_its_base_status_and_the_same_body() -> None:
    class Narrow(PlanError):
        pass

    class Remote(StoreError):
        pass

    assert (status_for(Narrow("x")), status_for(Remote("x"))) == (422, 502)
    answer = response_for(Narrow("dim 0 has size 7"))
    assert answer.status_code == 422
    assert json.loads(answer.body) == {"error": "Narrow", "detail": "dim 0 has size 7"}


def test_library_errors_know_nothing_of_http() -> None:
    source = inspect.getsource(errors)
    assert "http_status" not in source and not any(hasattr(c, "http_status") for c in vars(errors).values())
