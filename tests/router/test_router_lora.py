"""LoRA adapters: what the router reads from /metrics, and how it chooses for an adapter."""

from __future__ import annotations

from tests.router.conftest import wait_until
from tidegate.engine.router.adapters import UNKNOWN, Adapters, read_adapters
from tidegate.engine.router.exposition import parse_exposition
from tidegate.engine.router.health import reported_load
from tidegate.engine.router.instances import InstancePool
from tidegate.engine.router.routing import Route
from tidegate.engine.router.selection import affinity_key, rendezvous_order

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8}


def adapters_of(text: str) -> Adapters:
    return read_adapters(parse_exposition(text))


def pool_of(adapters: dict[str, Adapters], loads: dict[str, float] | None = None) -> InstancePool:
    """A decode pool of healthy instances with these adapters (and loads)."""
    pool = InstancePool("decode")
    pool.set_urls(adapters)
    for instance in pool:
        pool.mark_healthy(instance)
        instance.adapters = adapters[instance.url]
        instance.external_load = (loads or {}).get(instance.url, 0.0)
    return pool


def key_preferring(url: str, urls: list[str], model: str) -> str:
    """An affinity key for `model` whose rendezvous order puts `url` first among `urls`."""
    for i in range(1000):
        key = affinity_key({"model": model, "prompt": f"prompt {i}"}) or ""
        if rendezvous_order(key, urls)[0] == url:
            return key
    raise AssertionError("no prompt prefers " + url)


def first_choice(model: str, prompt: str, urls: list[str]) -> str:
    """The instance that affinity alone picks for this model and prompt."""
    return rendezvous_order(affinity_key({"model": model, "prompt": prompt}) or "", urls)[0]


# Parsing.


def test_label_values_are_unescaped_and_bad_lines_skipped_without_losing_the_rest():
    page = parse_exposition(
        '# HELP x:info Has \\ and " in help.\n'
        "# TYPE x:info gauge\n"
        'x:info{a="say \\"hi\\"",b="back\\\\slash",c="two\\nlines",d="a,b}"} 1.5\n'
        'x:info{ a = "spaced" , } 2 1700000000000\n'
        "x:bare 3\n"
        'x:broken{a="never closed} 4\n'
        "x:novalue\n"
        "x:unquoted{a=b} 5\n"
        "x:toomany 1 2 3\n"
        "not a sample line\n"
        "x:nan NaN\n"
    )
    samples = [(s.name, dict(s.labels), s.value) for s in page.samples]
    assert samples[:3] == [
        ("x:info", {"a": 'say "hi"', "b": "back\\slash", "c": "two\nlines", "d": "a,b}"}, 1.5),
        ("x:info", {"a": "spaced"}, 2.0),  # the timestamp is not the value
        ("x:bare", {}, 3.0),
    ]
    assert [name for name, _, _ in samples[3:]] == ["x:nan"]
    assert page.declared == {"x:info"}
    assert page.knows("x:info") and page.knows("x:bare") and not page.knows("x:broken")


def test_only_the_named_metrics_are_parsed_and_unknown_escapes_are_kept():
    lines = [
        "# TYPE other histogram",
        'other_bucket{le="+Inf"} 4',
        'wanted{path="C:\\dir\\q",raw="\\q"} 1',
    ]
    page = parse_exposition("\n".join(lines), {"wanted"})
    assert [(s.name, dict(s.labels)) for s in page.samples] == [
        ("wanted", {"path": "C:\\dir\\q", "raw": "\\q"})
    ]
    assert page.knows("other")  # declared, though its samples were passed over


def test_load_survives_lines_it_cannot_parse():
    text = (
        'tidegate:num_requests_running{engine="0",model_name="a \\"b\\""} 3.0\n'
        'tidegate:num_requests_running{engine="1" 9.0\n'
        'tidegate:num_requests_waiting{engine="0"} 2.0 1700000000000\n'
        'tidegate:num_requests_waiting{engine="1"} NaN\n'
    )
    assert reported_load(text) == 5.0


def test_adapters_served_and_hot_from_the_gauges():
    adapters = adapters_of(
        "# TYPE tidegate:lora_adapter_ready gauge\n"
        'tidegate:lora_adapter_ready{adapter="sql"} 1\n'
        'tidegate:lora_adapter_ready{adapter="chat \\"v2\\""} 1\n'
        'tidegate:lora_adapter_ready{adapter="loading"} 0\n'
        'tidegate:lora_requests_info{max_lora="4",running_lora_adapters="sql,,chat \\"v2\\"",'
        'waiting_lora_adapters="math"} 1.7e9\n'
    )
    assert adapters.served == {"sql", 'chat "v2"'}
    assert adapters.hot == {"sql", 'chat "v2"', "math"}
    assert adapters.serves("sql") and adapters.is_hot("sql")
    assert not adapters.serves("loading") and not adapters.serves("math")


def test_only_the_newest_info_series_of_each_engine_core_counts():
    adapters = adapters_of(
        # vLLM keeps every label set it ever set, each with the time it was set.
        'vllm:lora_requests_info{engine="0",max_lora="2",running_lora_adapters="old",'
        'waiting_lora_adapters=""} 1.6e9\n'
        'vllm:lora_requests_info{engine="0",max_lora="2",running_lora_adapters="a",'
        'waiting_lora_adapters="b"} 1.7e9\n'
        'vllm:lora_requests_info{engine="1",max_lora="2",running_lora_adapters="",'
        'waiting_lora_adapters="c"} 1.65e9\n'
    )
    assert adapters.hot == {"a", "b", "c"}
    # No readiness gauge (plain vLLM): a hot adapter is one it serves, nothing else is known.
    assert adapters.served is None
    assert adapters.serves("a") and not adapters.serves("old")


def test_absent_metrics_are_unknown_and_declared_empty_ones_are_none():
    assert adapters_of('tidegate:num_requests_running{engine="0"} 1\n') == UNKNOWN
    assert adapters_of("") == UNKNOWN
    empty = adapters_of(
        "# TYPE tidegate:lora_adapter_ready gauge\n# TYPE tidegate:lora_requests_info gauge\n"
    )
    assert empty == Adapters(served=frozenset(), hot=frozenset())
    idle = adapters_of(
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.7e9\n'
    )
    assert idle == Adapters(served=None, hot=frozenset())


# Choice.


def test_an_adapter_goes_to_an_instance_that_serves_it_and_hot_ones_first():
    a, b, c, d = URLS
    pool = pool_of(
        {
            a: Adapters(served=frozenset({"sql"}), hot=frozenset()),
            b: Adapters(served=frozenset({"sql"}), hot=frozenset({"sql"})),
            c: Adapters(served=frozenset({"chat"}), hot=frozenset({"chat"})),
            d: UNKNOWN,
        }
    )
    for i in range(20):
        key = affinity_key({"model": "sql", "prompt": f"p{i}"}) or ""
        assert pool.pick(Route(key, model="sql")).url == b
        # The hot one down or tried: the other that serves it, never one that does not.
        assert pool.pick(Route(key, model="sql"), exclude={b}).url == a


def test_among_hot_instances_affinity_decides_and_load_still_bounds():
    a, b, c = URLS[:3]
    hot = Adapters(served=frozenset({"sql"}), hot=frozenset({"sql"}))
    cold = Adapters(served=frozenset({"sql"}), hot=frozenset())
    pool = pool_of({a: hot, b: hot, c: cold})
    key = key_preferring(a, [a, b], "sql")
    assert pool.pick(Route(key, model="sql")).url == a
    key = key_preferring(b, [a, b], "sql")
    assert pool.pick(Route(key, model="sql")).url == b
    # Past the load bound (2 + 25 % of the least) a hot instance yields to a cold one.
    busy = pool_of({a: hot, c: cold}, loads={a: 3.0})
    assert busy.pick(Route(key_preferring(a, [a, c], "sql"), model="sql")).url == c
    within = pool_of({a: hot, c: cold}, loads={a: 2.0})
    assert within.pick(Route(key_preferring(c, [a, c], "sql"), model="sql")).url == a


def test_an_adapter_no_instance_serves_and_the_base_model_go_by_affinity_alone():
    a, b = URLS[:2]
    pool = pool_of({a: Adapters(served=frozenset({"sql"}), hot=frozenset({"sql"})), b: UNKNOWN})
    for i in range(20):
        key = affinity_key({"model": "tiny", "prompt": f"p{i}"}) or ""
        expected = rendezvous_order(key, [a, b])[0]
        assert pool.pick(Route(key, model="tiny")).url == expected  # the base model
        assert pool.pick(Route(key, model="nope")).url == expected  # unknown: the engine says 404
        assert pool.pick(Route(key)).url == expected
    # Only an instance down serves it: any healthy one rather than none.
    pool.mark_down(pool.pick(Route(key_preferring(a, [a, b], "sql"), model="sql")), "refused")
    assert (
        pool.pick(Route(affinity_key({"model": "sql", "prompt": "x"}) or "", model="sql")).url == b
    )


def test_an_instance_that_goes_down_forgets_its_adapters():
    pool = pool_of({URLS[0]: Adapters(served=frozenset({"sql"}), hot=frozenset())})
    [instance] = pool
    pool.mark_down(instance, "GET /health failed")
    assert instance.adapters == UNKNOWN


def test_affinity_is_per_adapter_stable_for_each_and_different_across_them():
    prompts = [f"a long shared system prompt, variant {i}" for i in range(50)]
    served = Adapters(served=frozenset({"sql", "chat"}), hot=frozenset())
    pool = pool_of(dict.fromkeys(URLS, served))

    def chosen(model: str, prompt: str) -> str:
        key = affinity_key({"model": model, "prompt": prompt}) or ""
        return pool.pick(Route(key, model=model)).url

    sql = [chosen("sql", p) for p in prompts]
    assert sql == [chosen("sql", p) for p in prompts]  # stable
    chat = [chosen("chat", p) for p in prompts]
    assert chat == [chosen("chat", p) for p in prompts]
    # The same prompt under another adapter is another key: a different instance for most.
    assert sum(x != y for x, y in zip(sql, chat, strict=True)) > len(prompts) // 2
    assert affinity_key({"model": "sql", "prompt": "p"}) != affinity_key(
        {"model": "chat", "prompt": "p"}
    )


# Through the router's HTTP app.


def test_the_balancer_sends_an_adapter_where_it_is_served_and_follows_changes(backend, router):
    plain = backend("decode", adapters=[])
    serving = backend("decode", adapters=["sql"], running_adapters=["sql"])
    balancer = router([], [plain.url, serving.url])  # its first health round is done
    for i in range(6):
        body = {**BODY, "model": "sql", "prompt": f"prompt {i} " * 40}
        response = balancer.client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["engine"] == serving.engine.name
    # The base model is no adapter: it spreads as before.
    for i in range(8):
        body = {**BODY, "prompt": f"prompt {i} " * 40}
        assert balancer.client.post("/v1/completions", json=body).status_code == 200
    assert plain.engine.received and len(serving.engine.received) > 6
    # Served nowhere: some instance gets it, and its 404 reaches the client.
    missing = balancer.client.post("/v1/completions", json={**BODY, "model": "nope"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"].endswith("has no model nope")
    # The adapter moves: the health rounds see it, and requests follow.
    serving.engine.adapters, plain.engine.adapters = [], ["sql"]
    body = {**BODY, "model": "sql"}
    wait_until(
        lambda: (
            balancer.client.post("/v1/completions", json=body).status_code == 200
            and plain.engine.received[-1].body["model"] == "sql"
        ),
        what="sql requests to follow the adapter",
    )


def test_the_same_prompt_under_two_adapters_keeps_to_its_own_instance(backend, router):
    first = backend("decode", adapters=["sql", "chat"])
    second = backend("decode", adapters=["sql", "chat"])
    balancer = router([], [first.url, second.url])
    urls = [first.url, second.url]
    names = {first.url: first.engine.name, second.url: second.engine.name}
    prompt = next(
        f"prompt {i}"
        for i in range(1000)
        if first_choice("sql", f"prompt {i}", urls) != first_choice("chat", f"prompt {i}", urls)
    )
    for model in ("sql", "chat", "sql", "chat"):
        body = {**BODY, "model": model, "prompt": prompt}
        expected = first_choice(model, prompt, urls)
        response = balancer.client.post("/v1/completions", json=body)
        assert response.json()["engine"] == names[expected], model


def test_both_pd_legs_go_to_instances_that_serve_the_adapter(backend, router):
    p_plain, p_sql = backend("prefill", adapters=[]), backend("prefill", adapters=["sql"])
    d_sql, d_plain = backend("decode", adapters=["sql"]), backend("decode", adapters=[])
    proxy = router([p_plain.url, p_sql.url], [d_sql.url, d_plain.url])
    for i in range(4):
        body = {**BODY, "model": "sql", "prompt": f"prompt {i} " * 40}
        assert proxy.client.post("/v1/completions", json=body).status_code == 200
    assert p_plain.engine.received == d_plain.engine.received == []
    assert len(p_sql.engine.received) == len(d_sql.engine.received) == 4
    remote = {leg.body["kv_transfer_params"]["remote_engine"] for leg in d_sql.engine.received}
    assert remote == {p_sql.engine.name}
