"""The P/D wire protocol, without sockets: layouts, the handshake, messages, frames, the gate."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading

import pytest

from phasewise.disagg import wire as w

LAYOUT = w.KVLayout(model_id="LlamaForCausalLM:abc123", dtype="float32", num_layers=2,
                    num_kv_heads=2, head_dim=4, block_size=4)
SECRET = os.urandom(32)
FRAME_BYTES = LAYOUT.block_layer_bytes() * LAYOUT.num_layers  # one block, every layer

# A value for each layout field that differs from LAYOUT's.
OTHER = {"model_id": "LlamaForCausalLM:def456", "dtype": "bfloat16", "num_layers": 3,
         "num_kv_heads": 4, "head_dim": 8, "block_size": 16,
         "cache_layout": "kv,layers,blocks,block_size,kv_heads,head_dim",
         "block_hash_scheme": "sha256/int64le"}


def test_every_layout_field_has_a_different_value_in_the_table():
    assert set(OTHER) == {f.name for f in dataclasses.fields(w.KVLayout)}


# ---- layout


def test_compat_hash_is_stable_and_canonical():
    same = w.KVLayout(**LAYOUT.to_dict())
    assert same.compat_hash() == LAYOUT.compat_hash()
    assert len(LAYOUT.compat_hash()) == 64
    int(LAYOUT.compat_hash(), 16)


@pytest.mark.parametrize("name", sorted(OTHER))
def test_layout_mismatch_names_the_field_and_both_values(name):
    other = dataclasses.replace(LAYOUT, **{name: OTHER[name]})
    assert other.compat_hash() != LAYOUT.compat_hash()
    (diff,) = LAYOUT.mismatches(other)
    assert diff.startswith(f"{name}: ")
    assert repr(getattr(LAYOUT, name)) in diff and repr(OTHER[name]) in diff
    assert LAYOUT.mismatched_fields(other) == [name]


def test_layout_validation_names_field_and_allowed_values():
    with pytest.raises(w.MessageError) as e:
        dataclasses.replace(LAYOUT, dtype="float64")
    assert e.value.field == "dtype" and "bfloat16" in str(e.value)
    with pytest.raises(w.MessageError) as e:
        dataclasses.replace(LAYOUT, num_layers=0)
    assert e.value.field == "num_layers"
    with pytest.raises(w.MessageError) as e:
        dataclasses.replace(LAYOUT, block_size=True)
    assert e.value.field == "block_size"


def test_block_bytes_follow_the_cache_layout():
    assert LAYOUT.block_layer_bytes() == 2 * 4 * 2 * 4 * 4  # kv, block, heads, dim, fp32
    mla = dataclasses.replace(LAYOUT, cache_layout="layers,blocks,block_size,kv_heads,head_dim")
    assert mla.block_layer_bytes() == LAYOUT.block_layer_bytes() // 2


def test_frame_shape_follows_the_cache_layout():
    h = w.decode_kv_frame(w.encode_kv_frame(
        request_id="r", epoch=0, seq=0, first_block=2, num_blocks=3, first_token=8,
        num_tokens=9, layer_start=1, layer_end=2, dtype="float32",
        payload=os.urandom(3 * LAYOUT.block_layer_bytes())))[0]
    shape = LAYOUT.frame_shape(h)
    assert shape == (1, 2, 3, 4, 2, 4)
    assert 4 * shape[0] * shape[1] * shape[2] * shape[3] * shape[4] * shape[5] == h.nbytes
    odd = dataclasses.replace(LAYOUT, cache_layout="layers,kv,pages")
    with pytest.raises(ValueError, match="pages"):
        odd.frame_shape(h)


# ---- handshake


def _hello(secret=SECRET, layout=LAYOUT, version=w.PROTOCOL_VERSION, role="prefill"):
    ch = w.make_challenge("server-1")
    return ch, w.make_hello(ch, secret=secret, identity="client-1", name="prefill-0",
                            role=role, layout=layout, version=version)


def test_a_good_handshake_verifies_both_ways():
    ch, hello = _hello()
    wire_hello = w.decode_message(w.encode_message(hello))
    assert wire_hello == hello
    w.verify_hello(wire_hello, ch, secret=SECRET, layout=LAYOUT)
    acc = w.decode_message(w.encode_message(w.make_accept(hello, ch, secret=SECRET)))
    w.verify_accept(acc, hello, ch, secret=SECRET)


def test_wrong_secret_is_auth():
    ch, hello = _hello(secret=os.urandom(32))
    with pytest.raises(w.HandshakeError) as e:
        w.verify_hello(hello, ch, secret=SECRET, layout=LAYOUT)
    assert e.value.field == "auth"


def test_a_server_without_the_key_is_caught_by_the_client():
    ch, hello = _hello()
    forged = w.make_accept(hello, ch, secret=os.urandom(32))
    with pytest.raises(w.HandshakeError) as e:
        w.verify_accept(forged, hello, ch, secret=SECRET)
    assert e.value.field == "auth"
    # nor can the client's own mac be reflected back as the server's
    reflected = w.Accept(server_identity=ch.server_identity, identity=hello.identity,
                         mac=hello.mac, max_frame_bytes=w.DEFAULT_MAX_FRAME_BYTES)
    with pytest.raises(w.HandshakeError):
        w.verify_accept(reflected, hello, ch, secret=SECRET)


def test_tampering_with_any_signed_field_breaks_the_mac():
    ch, hello = _hello()
    for change in ({"identity": "client-2"}, {"name": "prefill-9"}, {"role": "router"},
                   {"client_nonce": w.new_nonce()}):
        with pytest.raises(w.HandshakeError) as e:
            w.verify_hello(dataclasses.replace(hello, **change), ch, secret=SECRET,
                           layout=LAYOUT)
        assert e.value.field == "auth", change


def test_a_replayed_hello_is_refused():
    book = w.ChallengeBook("server-1")
    ch = book.issue(b"conn-1")
    hello = w.make_hello(ch, secret=SECRET, identity="c", role="prefill", layout=LAYOUT)
    taken = book.take(b"conn-1")
    assert taken is not None
    w.verify_hello(hello, taken, secret=SECRET, layout=LAYOUT)
    # the same bytes again: the challenge was used up
    assert book.take(b"conn-1") is None
    # or on another connection, which was issued a fresh nonce
    fresh = book.issue(b"conn-2")
    with pytest.raises(w.HandshakeError) as e:
        w.verify_hello(hello, fresh, secret=SECRET, layout=LAYOUT)
    assert e.value.field == "nonce"


def test_challenges_expire_and_are_bounded():
    now = [0.0]
    book = w.ChallengeBook("s", capacity=2, ttl=10.0, clock=lambda: now[0])
    book.issue(b"a")
    now[0] = 11.0
    assert book.take(b"a") is None
    for p in (b"x", b"y", b"z"):
        book.issue(p)
    assert len(book) == 2 and book.take(b"x") is None and book.take(b"z") is not None


def test_version_mismatch_is_refused():
    ch, hello = _hello(version=w.PROTOCOL_VERSION + 1)
    with pytest.raises(w.HandshakeError) as e:
        w.verify_hello(hello, ch, secret=SECRET, layout=LAYOUT)
    assert e.value.field == "version"


def test_unknown_role_is_refused():
    ch, hello = _hello(role="janitor")
    with pytest.raises(w.HandshakeError) as e:
        w.verify_hello(hello, ch, secret=SECRET, layout=LAYOUT)
    assert e.value.field == "role" and "prefill" in e.value.reason


@pytest.mark.parametrize("name", sorted(OTHER))
def test_layout_mismatch_is_refused_at_handshake_naming_the_field(name):
    ch, hello = _hello(layout=dataclasses.replace(LAYOUT, **{name: OTHER[name]}))
    with pytest.raises(w.HandshakeError) as e:
        w.verify_hello(hello, ch, secret=SECRET, layout=LAYOUT)
    assert e.value.field == f"layout.{name}"
    assert repr(OTHER[name]) in e.value.reason


def test_short_secret_is_refused():
    with pytest.raises(ValueError, match="secret"):
        w.check_secret(b"short")



def test_a_challenge_names_nothing_of_the_layout():
    """A challenge goes to anyone who asks; the server compares layouts itself, once the
    hello's MAC shows the peer holds the key."""
    assert {f.name for f in dataclasses.fields(w.Challenge)} == {
        "server_identity", "nonce", "version"}
    data = w.encode_message(w.ChallengeBook("server-1").issue(b"conn"))
    for value in (LAYOUT.model_id, LAYOUT.compat_hash(), LAYOUT.dtype, LAYOUT.cache_layout):
        assert value.encode() not in data


def test_the_accept_mac_covers_the_frame_limit():
    ch, hello = _hello()
    acc = w.make_accept(hello, ch, secret=SECRET, max_frame_bytes=1 << 20)
    w.verify_accept(acc, hello, ch, secret=SECRET)
    with pytest.raises(w.HandshakeError) as e:
        w.verify_accept(dataclasses.replace(acc, max_frame_bytes=1 << 30), hello, ch,
                        secret=SECRET)
    assert e.value.field == "auth"


# ---- control messages


MESSAGES = [
    w.PrefillRequest(request_id="r1", epoch=3, token_ids=(5, 6, 7), params={"temperature": 0.0,
                     "stop": ["\n"]}, num_blocks=2, first_block=1),
    w.FirstToken(request_id="r1", epoch=3, token_id=42, logprobs={"42": -0.25, "7": -2.5}),
    w.FirstToken(request_id="r1", epoch=3, token_id=42),
    w.Done(request_id="r1", epoch=3, num_frames=4),
    w.Error(request_id="r1", epoch=3, reason="oom", detail="no free blocks"),
    w.Abort(request_id="r1", epoch=3),
    w.Heartbeat(identity="p", seq=9),
    w.Bye(identity="p"),
    w.Open(identity="p"),
    w.Refuse(field="layout.dtype", reason="x"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_as_compact_sorted_json(msg):
    data = w.encode_message(msg)
    assert w.decode_message(data) == msg
    obj = json.loads(data)
    assert obj["kind"] == type(msg).KIND
    assert data == json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _obj(msg):
    return json.loads(w.encode_message(msg))


@pytest.mark.parametrize("mutate, field", [
    (lambda o: o.update(kind="exec"), "kind"),
    (lambda o: o.pop("kind"), "kind"),
    (lambda o: o.update(kind=7), "kind"),
    (lambda o: o.update(surprise=1), "surprise"),
    (lambda o: o.pop("epoch"), "epoch"),
    (lambda o: o.update(epoch="3"), "epoch"),
    (lambda o: o.update(epoch=True), "epoch"),
    (lambda o: o.update(epoch=3.0), "epoch"),
    (lambda o: o.update(epoch=-1), "epoch"),
    (lambda o: o.update(token_ids=["5"]), "token_ids[0]"),
    (lambda o: o.update(token_ids=5), "token_ids"),
    (lambda o: o.update(token_ids=[]), "token_ids"),
    (lambda o: o.update(params=[1]), "params"),
    (lambda o: o.update(request_id=""), "request_id"),
    (lambda o: o.update(request_id=None), "request_id"),
    (lambda o: o.update(first_block=9), "first_block"),
])
def test_decode_message_refuses_bad_fields_naming_them(mutate, field):
    obj = _obj(MESSAGES[0])
    mutate(obj)
    with pytest.raises(w.MessageError) as e:
        w.decode_message(json.dumps(obj).encode())
    assert e.value.field == field


def test_decode_message_refuses_nested_and_optional_type_errors():
    obj = _obj(MESSAGES[1])
    obj["logprobs"] = {"42": "high"}
    with pytest.raises(w.MessageError) as e:
        w.decode_message(json.dumps(obj).encode())
    assert e.value.field == "logprobs.42"
    _, hello = _hello()
    obj = _obj(hello)
    obj["layout"]["head_dim"] = "4"
    with pytest.raises(w.MessageError) as e:
        w.decode_message(json.dumps(obj).encode())
    assert e.value.field == "layout.head_dim"
    obj["layout"] = "LAYOUT"
    with pytest.raises(w.MessageError) as e:
        w.decode_message(json.dumps(obj).encode())
    assert e.value.field == "layout"


@pytest.mark.parametrize("data", [
    b"", b"\xff\xfe", b"[1,2]", b"null", b'"abort"',
    b'{"kind":"abort","request_id":"r","epoch":1,"epoch":2}',
    b'{"kind":"first_token","request_id":"r","epoch":1,"token_id":1,"logprobs":{"1":NaN}}',
    b"{\"kind\": \"abort\", \"request_id\": \"r\", \"epoch\": __import__('os')}",
])
def test_decode_message_refuses_non_messages(data):
    with pytest.raises(w.MessageError):
        w.decode_message(data)



def test_decode_message_bounds_nesting_without_a_recursion_error():
    deep = b'{"kind":"open","identity":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(w.MessageError, match="nest"):
        w.decode_message(deep)
    with pytest.raises(w.MessageError, match="nest"):
        w.decode_message(b"{" * 5000)
    ok = w.PrefillRequest(request_id="r", epoch=1, token_ids=(1,), num_blocks=1,
                          params={"a": json.loads("[" * (w.MAX_NESTING - 2) + "]" *
                                                  (w.MAX_NESTING - 2))})
    assert w.decode_message(w.encode_message(ok)) == ok
    too_deep = dataclasses.replace(ok, params={"a": json.loads("[" * w.MAX_NESTING +
                                                                "]" * w.MAX_NESTING)})
    with pytest.raises(w.MessageError, match="nest"):
        w.decode_message(w.encode_message(too_deep))
    # brackets inside strings are text, not nesting
    brackets = dataclasses.replace(ok, params={"stop": ["[{" * 1000, "\\\"[[["]})
    assert w.decode_message(w.encode_message(brackets)) == brackets


def test_decode_message_refuses_a_message_over_its_limit_unread():
    data = w.encode_message(w.Open(identity="x" * 100))
    assert w.decode_message(data, max_bytes=len(data)) == w.Open(identity="x" * 100)
    with pytest.raises(w.MessageError, match="exceeds"):
        w.decode_message(data, max_bytes=len(data) - 1)
    with pytest.raises(w.MessageError, match="exceeds"):
        w.decode_message(memoryview(b"{" * (w.MAX_MESSAGE_BYTES + 1)))


def test_encode_message_refuses_non_messages():
    with pytest.raises(TypeError):
        w.encode_message({"kind": "abort"})
    with pytest.raises(TypeError):
        w.encode_message(LAYOUT)


# ---- KV frames


def _frame(payload=None, **over):
    fields = dict(request_id="r1", epoch=1, seq=0, first_block=0, num_blocks=1, first_token=0,
                  num_tokens=4, layer_start=0, layer_end=2, dtype="float32")
    fields.update(over)
    return w.encode_kv_frame(payload=os.urandom(FRAME_BYTES) if payload is None else payload,
                             **fields)


@pytest.mark.parametrize("algorithm", w.CHECKSUMS)
def test_kv_frames_round_trip_payload_bytes_intact(algorithm):
    payload = os.urandom(3 * FRAME_BYTES)
    parts = w.encode_kv_frame(request_id="r1", epoch=2, seq=5, first_block=3, num_blocks=3,
                              first_token=12, num_tokens=10, layer_start=0, layer_end=2,
                              dtype="float32", payload=payload, algorithm=algorithm)
    header, got = w.decode_kv_frame([bytes(p) for p in parts])
    assert bytes(got) == payload
    assert header.nbytes == len(payload) and header.checksum.startswith(algorithm + ":")
    assert (header.request_id, header.epoch, header.seq, list(header.blocks())) == \
        ("r1", 2, 5, [3, 4, 5])


def test_kv_frame_payloads_travel_in_parts_of_a_fixed_size():
    payload = os.urandom(3 * 1000 + 7)
    parts = w.encode_kv_frame(request_id="r1", epoch=1, seq=0, first_block=0, num_blocks=1,
                              first_token=0, num_tokens=4, layer_start=0, layer_end=2,
                              dtype="float32", payload=payload, part_bytes=1000)
    assert [len(p) for p in parts[1:]] == [1000, 1000, 1000, 7]
    header, got = w.decode_kv_frame([bytes(p) for p in parts])
    assert bytes(got) == payload and header.nbytes == len(payload)
    # the default: one part up to KV_PART_BYTES, then parts of that size
    assert len(_frame(payload=bytes(w.KV_PART_BYTES))) == 2
    assert [len(p) for p in _frame(payload=bytes(w.KV_PART_BYTES + 1))[1:]] == \
        [w.KV_PART_BYTES, 1]
    with pytest.raises(w.FrameError) as e:  # an empty part among several
        w.decode_kv_frame([parts[0], b"", *parts[1:]])
    assert e.value.kind == "malformed"
    with pytest.raises(w.FrameError) as e:  # over the receiver's limit: nothing joined
        w.decode_kv_frame(parts, max_payload_bytes=len(payload) - 1)
    assert e.value.kind == "size" and e.value.header.seq == 0
    assert w.decode_kv_frame(parts, max_payload_bytes=len(payload))[0].nbytes == len(payload)


def test_curve_keys_are_derived_from_the_secret():
    a = w.curve_secret_key(SECRET, "server")
    assert a == w.curve_secret_key(SECRET, "server") and len(a) == 32
    assert a != w.curve_secret_key(SECRET, "client")
    assert a != w.curve_secret_key(os.urandom(32), "server")
    with pytest.raises(ValueError, match="secret"):
        w.curve_secret_key(b"short", "server")


def test_kv_frame_accepts_any_buffer():
    import array

    arr = array.array("f", [1.0] * (FRAME_BYTES // 4))
    header, got = w.decode_kv_frame(_frame(payload=memoryview(arr)))
    assert bytes(got) == arr.tobytes()


def test_frame_errors_have_their_kind():
    header, payload = _frame()
    corrupt = bytearray(payload)
    corrupt[7] ^= 0x01
    with pytest.raises(w.FrameError) as e:
        w.decode_kv_frame([header, bytes(corrupt)])
    assert e.value.kind == "checksum" and e.value.header.seq == 0
    with pytest.raises(w.FrameError) as e:
        w.decode_kv_frame([header, payload[:-1]])
    assert e.value.kind == "size"
    for parts in ([header], [header, payload, b""], [b"{}", payload],
                  [w.encode_message(w.Abort(request_id="r", epoch=1)), payload],
                  [header.replace(b"blake2b-128:", b"md5:"), payload]):
        with pytest.raises(w.FrameError) as e:
            w.decode_kv_frame(parts)
        assert e.value.kind == "malformed"
    with pytest.raises(ValueError):
        w.FrameError("other", "x")


# ---- the gate


def _h(**over):
    return w.decode_kv_frame(_frame(**over))[0]


def _gate(total_blocks=4, **kw):
    g = w.FrameGate(LAYOUT)
    g.expect("r1", 1, total_blocks, **kw)
    return g


def test_gate_admits_each_block_once_and_tracks_completion():
    g = _gate(total_blocks=2)
    assert not g.complete("r1")
    assert g.admit(_h(seq=0, first_block=1, first_token=4, num_tokens=3)) == "ok"
    assert g.missing_blocks("r1") == [0] and g.landed_prefix("r1") == 0
    assert g.admit(_h(seq=1)) == "ok"
    assert g.complete("r1") and g.landed_prefix("r1") == 2
    assert g.counters()["ok"] == 2


def test_gate_outcomes():
    g = _gate(total_blocks=2, peer="p1")
    g.admit(_h(seq=0), "p1")
    cases = [
        (_h(seq=0), "p1", "duplicate"),
        (_h(seq=5), "p1", "duplicate"),  # new seq, but block 0 already landed
        (_h(seq=0, first_block=1, first_token=4), "p1", "duplicate"),  # seq reused
        (_h(seq=1, request_id="r9"), "p1", "foreign"),
        (_h(seq=1, epoch=2), "p1", "foreign"),  # an epoch the receiver never issued
        (_h(seq=1, first_block=1, first_token=4), "p2", "foreign"),  # not the bound peer
        (_h(seq=1, first_block=2, first_token=8), "p1", "out_of_range"),
        (_h(seq=1, first_block=1, first_token=4, layer_start=1, layer_end=3,
            payload=os.urandom(FRAME_BYTES)), "p1", "out_of_range"),
        (_h(seq=1, first_block=1, first_token=4, dtype="float16"), "p1", "mismatch"),
        (_h(seq=1, first_block=1, first_token=4, payload=b"x" * 8), "p1", "mismatch"),
        (_h(seq=1, first_block=1, first_token=5), "p1", "mismatch"),
        (_h(seq=1, first_block=1, first_token=4, num_tokens=5), "p1", "mismatch"),
    ]
    for header, peer, want in cases:
        assert g.admit(header, peer) == want, header
    assert not g.complete("r1")
    c = g.counters()
    assert c == {"ok": 1, "duplicate": 3, "foreign": 3, "out_of_range": 2, "mismatch": 4,
                 "stale": 0}


def test_gate_refuses_stale_epochs_after_a_retry():
    g = _gate()
    g.admit(_h(seq=0))
    g.expect("r1", 2, 4)  # the retry: a new attempt, nothing of the old one kept
    assert g.missing_blocks("r1") == [0, 1, 2, 3]
    assert g.admit(_h(seq=1, first_block=1, first_token=4)) == "stale"
    assert g.admit(_h(seq=0, epoch=2)) == "ok"
    with pytest.raises(ValueError, match="epoch"):
        g.expect("r1", 2, 4)


def test_gate_layers_land_separately():
    g = _gate(total_blocks=1)
    half = LAYOUT.block_layer_bytes()
    assert g.admit(_h(seq=0, layer_start=1, layer_end=2, payload=os.urandom(half))) == "ok"
    assert not g.complete("r1")
    assert g.admit(_h(seq=1, layer_start=1, layer_end=2, payload=os.urandom(half))) == \
        "duplicate"
    assert g.admit(_h(seq=2, layer_start=0, layer_end=1, payload=os.urandom(half))) == "ok"
    assert g.complete("r1")


def test_gate_reports_missing_seqs_after_done():
    g = _gate(total_blocks=3)
    g.admit(_h(seq=0))
    g.admit(_h(seq=2, first_block=2, first_token=8))
    assert g.missing_seqs("r1") is None
    assert not g.note_done("r1", 0, 3)  # not the current epoch
    assert g.note_done("r1", 1, 3)
    assert g.missing_seqs("r1") == [1] and g.missing_blocks("r1") == [1]
    assert g.landed_prefix("r1") == 1


def test_gate_forget_and_forget_peer():
    g = w.FrameGate(LAYOUT)
    g.expect("a", 1, 1, peer="p1")
    g.expect("b", 1, 1, peer="p1")
    g.expect("c", 1, 1, peer="p2")
    assert g.forget_peer("p1") == ["a", "b"]
    assert g.admit(_h(request_id="a"), "p1") == "foreign"
    assert g.forget("c") and not g.forget("c")
    assert g.admit(_h(request_id="c"), "p2") == "foreign"
    assert g.pending() == [] and not g.complete("c")


def test_gate_apply_runs_under_the_lock_and_failure_lands_nothing():
    g = _gate(total_blocks=2)
    seen = []

    def boom(h):
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError):
        g.admit(_h(seq=0), apply=boom)
    assert g.missing_blocks("r1") == [0, 1] and g.counters()["ok"] == 0

    # forget() from another thread must wait for an in-progress apply
    entered, release = threading.Event(), threading.Event()
    forgot = []

    def slow(h):
        entered.set()
        release.wait(10)
        seen.append(h.seq)

    t = threading.Thread(target=lambda: g.admit(_h(seq=1), apply=slow))
    t.start()
    assert entered.wait(10)
    f = threading.Thread(target=lambda: forgot.append(g.forget("r1")))
    f.start()
    f.join(0.2)
    assert forgot == []  # still blocked behind the copy
    release.set()
    t.join(10)
    f.join(10)
    assert seen == [1] and forgot == [True]


def test_wire_imports_without_torch_or_zmq():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['zmq'] = None\n"
            "import phasewise.disagg.wire as w; print(w.PROTOCOL_VERSION)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(w.PROTOCOL_VERSION)
