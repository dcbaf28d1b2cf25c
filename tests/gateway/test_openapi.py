"""The OpenAPI document matches what is served (SPEC section 14)."""

from __future__ import annotations

import re

import httpx
import pytest
from django.urls import URLPattern, get_resolver
from jsonschema import Draft202012Validator

from buzz_delivery.gateway import urls as gateway_urls
from buzz_delivery.gateway.openapi import EXAMPLES, RUN_EXAMPLES, document
from buzz_delivery.testing import CommunityFactory
from tests.gateway.support import deliver, enroll, new_agent

GET_ROUTES = {"openapi", "me", "delivery", "run"}  # URL names; every other route is a POST


def validator(doc: dict, name: str) -> Draft202012Validator:
    return Draft202012Validator({**doc, "$ref": f"#/components/schemas/{name}"})


def served_routes() -> set[tuple[str, str]]:
    """(OpenAPI path, method) of every route in the gateway's URLconf."""
    out = set()
    for pattern in gateway_urls.urlpatterns:
        assert isinstance(pattern, URLPattern)
        route = "/" + re.sub(r"<str:(\w+)>", r"{\1}", str(pattern.pattern))
        out.add((route, "get" if pattern.name in GET_ROUTES else "post"))
    return out


def test_every_route_served_is_in_the_document_and_nothing_else():
    doc = document()
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert documented == served_routes()
    # With buzz_delivery.agents installed (the example project), the run routes are served.
    assert ("/runs/claim", "post") in documented
    assert ("/communities/{community_id}/runs/{run_id}/compensations/finish", "post") in documented
    # The example project mounts it at /gateway/v1/.
    assert get_resolver().resolve("/gateway/v1/openapi.json").url_name == "openapi"


def test_the_document_is_a_valid_schema_set_and_every_example_validates():
    doc = document()
    for name, schema in doc["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema)
        examples = {**EXAMPLES, **RUN_EXAMPLES}
        assert name in examples, f"no example for {name}"
        validator(doc, name).validate(examples[name])
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
    # The batch finish and the agent-run path.
    deliver(community, agent.pubkey, 2)
    claims = agent.claim(limit=2)
    batch = agent.request(
        "POST",
        f"/communities/{community.id}/deliveries/finish",
        {"deliveries": [{"delivery_id": claims[0].lease.delivery_id, "lease_generation": 1}], "outcome": "finished"},
    )
    validator(doc, "BatchFinishResponse").validate(batch.json())
    renewals = agent.request(
        "POST",
        f"/communities/{community.id}/deliveries/renew",
        {"deliveries": [{"delivery_id": x.lease.delivery_id, "lease_generation": 1} for x in claims]},
    )
    assert [r["outcome"] for r in renewals.json()["results"]] == ["lease_lost", "renewed"]
    validator(doc, "BatchRenewResponse").validate(renewals.json())
    accepted = agent.request(
        "POST",
        f"/communities/{community.id}/deliveries/{claims[1].lease.delivery_id}/accept",
        {"lease_generation": 1},
    )
    validator(doc, "RunOutcome").validate(accepted.json())
    runs = agent.request("POST", "/runs/claim", {"limit": 1})
    validator(doc, "RunClaimResponse").validate(runs.json())
    lease = runs.json()["claims"][0]["lease"]
    run_base = f"/communities/{community.id}/runs/{lease['run_id']}"
    held = {"lease_generation": lease["lease_generation"], "worker_id": lease["worker_id"]}
    for action, body in (
        ("heartbeat", {}),
        ("calls", {"tool_name": "t", "args": {"a": 1}}),
        ("results", {"seq": 1, "ok": True, "output": [1]}),
    ):
        validator(doc, "RunOutcome").validate(agent.request("POST", f"{run_base}/{action}", {**held, **body}).json())
    validator(doc, "RunResponse").validate(agent.request("GET", run_base).json())
    validator(doc, "RunOutcome").validate(agent.request("POST", f"{run_base}/complete", {**held, "output": 1}).json())
    lost = agent.request("POST", f"{run_base}/heartbeat", {**held, "lease_generation": 99})
    assert lost.status_code == 409
    validator(doc, "Error").validate(lost.json())
    for refused in (
        agent.request("POST", base + "/renew", {"lease_generation": generation}),  # 409
        agent.request("POST", base + "/renew", {"lease_generation": "x"}),  # 400
        httpx.post(agent.base_url + "/deliveries/claim", timeout=10),  # 401
    ):
        assert refused.status_code in (400, 401, 409)
        validator(doc, "Error").validate(refused.json())
