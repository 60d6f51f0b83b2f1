from __future__ import annotations

import pytest

from tests.distributed.helpers import reference_losses


@pytest.fixture(scope="session")
def reference(tiny_model_dir, tmp_path_factory) -> dict[str, list[float]]:
    return reference_losses(tiny_model_dir, tmp_path_factory)
