"""The OpenAPI document matches what is served (SPEC section 14)."""

from __future__ import annotations

import re

import httpx
import pytest
from django.urls import URLPattern, get_resolver
from jsonschema import Draft202012Validator

from buzz_delivery.gateway import urls as gateway_urls
from buzz_delivery.gateway.openapi import EXAMPLES, document
from buzz_delivery.testing import CommunityFactory
from tests.gateway.support import deliver, enroll, new_agent

METHOD_OF_VIEW = {"openapi": "get", "me": "get", "claim": "post", "read": "get", "renew": "post", "finish": "post"}


def validator(doc: dict, name: str) -> Draft202012Validator:
    return Draft202012Validator({**doc, "$ref": f"#/components/schemas/{name}"})


def served_routes() -> set[tuple[str, str]]:
    """(OpenAPI path, method) of every route in the gateway's URLconf."""
    out = set()
    for pattern in gateway_urls.urlpatterns:
        assert isinstance(pattern, URLPattern)
        route = "/" + re.sub(r"<str:(\w+)>", r"{\1}", str(pattern.pattern))
        out.add((route, METHOD_OF_VIEW[pattern.callback.__name__]))
    return out


def test_every_route_served_is_in_the_document_and_nothing_else():
    doc = document()
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert documented == served_routes()
    # The example project mounts it at /gateway/v1/.
    assert get_resolver().resolve("/gateway/v1/openapi.json").url_name == "openapi"


def test_the_document_is_a_valid_schema_set_and_every_example_validates():
    doc = document()
    for name, schema in doc["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema)
        assert name in EXAMPLES, f"no example for {name}"
        validator(doc, name).validate(EXAMPLES[name])
    for ops in doc["paths"].values():
        for op in ops.values():
            for response in op["responses"].values():
                for media in response["content"].values():
                    if "$ref" in media["schema"]:
                        name = media["schema"]["$ref"].rsplit("/", 1)[1]
                        validator(doc, name).validate(media["example"])


def test_a_bad_example_fails_its_schema():
    doc = document()
    with pytest.raises(Exception, match="Additional properties"):
        validator(doc, "ClaimRequest").validate({"limit": 1, "target_pubkey": "00"})
    with pytest.raises(Exception, match="100"):
        validator(doc, "ClaimRequest").validate({"limit": 101})


@pytest.mark.django_db(transaction=True)
def test_served_document_and_real_responses_validate_against_it(gateway_server):
    doc = httpx.get(gateway_server.base + "/openapi.json", timeout=10).json()
    assert doc["servers"] == [{"url": "/gateway/v1"}]
    assert doc["paths"].keys() == document()["paths"].keys()
    # Bounds that are settings are the server's own (its test environment: a 10 s wait, 1 s leases).
    claim_schema = doc["components"]["schemas"]["ClaimRequest"]["properties"]
    assert claim_schema["wait_seconds"]["maximum"] == 10
    assert claim_schema["lease_seconds"]["minimum"] == 1
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    (delivery,) = deliver(community, agent.pubkey)
    base = f"/communities/{community.id}/deliveries/{delivery.id}"
    claim = agent.request("POST", "/deliveries/claim", {"limit": 2})
    validator(doc, "ClaimResponse").validate(claim.json())
    generation = claim.json()["claims"][0]["lease"]["lease_generation"]
    validator(doc, "MeResponse").validate(agent.request("GET", "/me").json())
    validator(doc, "DeliveryResponse").validate(agent.request("GET", base).json())
    validator(doc, "RenewResponse").validate(
        agent.request("POST", base + "/renew", {"lease_generation": generation}).json()
    )
    validator(doc, "FinishResponse").validate(
        agent.request("POST", base + "/finish", {"lease_generation": generation, "outcome": "finished"}).json()
    )
    for refused in (
        agent.request("POST", base + "/renew", {"lease_generation": generation}),  # 409
        agent.request("POST", base + "/renew", {"lease_generation": "x"}),  # 400
        httpx.post(agent.base_url + "/deliveries/claim", timeout=10),  # 401
    ):
        assert refused.status_code in (400, 401, 409)
        validator(doc, "Error").validate(refused.json())
