"""A request for a resource the emulator does not serve (a client's stale discovery cache, say) is answered as
kube-apiserver answers it: authorization first (403 for a user without the right), then 404 NotFound — never a
500 from the emulator itself."""

from __future__ import annotations

import pytest

from tests.test_apifaults_server import ADMIN, Api, api  # noqa: F401 (the fixture)

UNKNOWN = "/apis/inference.sluice.dev/v1alpha1/namespaces/default/inferencepools"


@pytest.mark.asyncio
async def test_an_unknown_resource_is_404_for_a_user_allowed_to_ask(api: Api) -> None:  # noqa: F811
    response = await api.session.get(UNKNOWN, headers=ADMIN)
    assert response.status == 404
    status = await response.json()
    assert status["reason"] == "NotFound"
    assert status["message"] == "the server could not find the requested resource (inferencepools.inference.sluice.dev)"


@pytest.mark.asyncio
async def test_an_unknown_resource_is_403_for_a_user_without_the_right(api: Api) -> None:  # noqa: F811
    response = await api.session.get(UNKNOWN, headers=api.bot)
    assert response.status == 403
    status = await response.json()
    assert status["reason"] == "Forbidden"
    assert status["message"] == (
        'inferencepools.inference.sluice.dev is forbidden: User "system:serviceaccount:default:bot" cannot list '
        'resource "inferencepools" in API group "inference.sluice.dev" in the namespace "default"'
    )
