"""Bad frames on the real sockets of real processes (issue 24). A rogue PUSH on a running
gateway's PULL and a rogue DEALER on its ROUTER; and the test as the gateway of a worker
process of its own. Random bytes, truncated and bit-flipped golden frames, unknown tags,
frames of a later protocol, frames from workers nobody spawned and forged ones in the real
worker's name: each is logged and dropped, and the process under attack serves on (same
pid, no restart). Fixed seeds and lists; every wait polls with a deadline."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import zmq

from shared.blas import worker_env
from shared.config import ModelConfig, ServerConfig
from shared.protocol import (
    PROTOCOL_VERSION,
    UNDECODABLE,
    Abort,
    Add,
    Capacity,
    Codec,
    ControlReply,
    FromWorker,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
    StepOutputs,
    WorkerDead,
    WorkerState,
)
from shared.types import (
    CanonicalRequest,
    FinishReason,
    Message,
    RequestKind,
    RequestOutput,
    SamplingParams,
)
from tests.gateway_proc import GatewayProc, openai_client, running_gateway, wait_for
from tests.test_protocol import FROM_WORKER, TO_WORKER

MESSAGES = [{"role": "user", "content": "Say something."}]
DEEP = b"\x91" * 100_000 + b"\xc0"  # a list in a list ... 100,000 deep: beyond msgspec's limit
UNDECODABLE_FROM_WORKER = "undecodable frame from a worker"
UNDECODABLE_FROM_GATEWAY = "undecodable frame from the gateway"


def pack(*values: object) -> bytes:
    return b"".join(msgspec.msgpack.encode(v) for v in values)


def mangled(golden: list[bytes], seed: int) -> list[bytes]:
    """Random bytes, and each golden frame truncated and bit-flipped, deterministically."""
    rng = random.Random(seed)
    frames = [b"", b"\xc1", rng.randbytes(1 << 20)]  # nothing, a reserved byte, a MiB of noise
    frames += [rng.randbytes(rng.randint(1, 300)) for _ in range(60)]
    for frame in golden:
        frames += [frame[: rng.randrange(len(frame))] for _ in range(3)]
        for _ in range(3):
            flipped = bytearray(frame)
            for _ in range(rng.randint(1, 4)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            frames.append(bytes(flipped))
    return frames


def refused(frames: list[bytes], decode: Any) -> list[bytes]:
    """The frames this side's decoder refuses: a flip may leave a valid frame (a Shutdown
    with another timeout is one), and a valid frame is not what these tests send blind."""
    bad = []
    for frame in frames:
        try:
            decode(frame)
        except UNDECODABLE:
            bad.append(frame)
    return bad


def golden(frames: dict[str, tuple[object, str]]) -> list[bytes]:
    return [bytes.fromhex(h) for _, h in frames.values()]


def zmq_socket(context: zmq.Context[zmq.Socket[bytes]], kind: int, **opts: Any) -> Any:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    return sock


def flood(sock: Any, message: list[bytes], most: int) -> int:
    """Send until the socket's queue stays full for 0.2 s (or `most` are sent): how many."""
    sent = full = 0
    while sent < most and full < 20:
        try:
            sock.send_multipart(message, flags=zmq.NOBLOCK)
            sent, full = sent + 1, 0
        except zmq.Again:
            full += 1
            time.sleep(0.01)
    return sent


# ---- the gateway's side -------------------------------------------------------------


@pytest.fixture(scope="module")
def wire_gateway(chat_model: Path) -> Iterator[GatewayProc]:
    with running_gateway(
        [{"name": "chat", "source": str(chat_model)}], request_timeout_s=60.0
    ) as gw:
        yield gw


def gateway_log(gw: GatewayProc) -> str:
    return (gw.run_dir / "gateway.log").read_text(errors="replace")


def socket_owner(gw: GatewayProc) -> psutil.Process:
    """The gateway's process that holds its ZeroMQ sockets (Granian serves the app, and its
    lifespan, in a process of its own)."""
    main = psutil.Process(gw.proc.pid)
    for proc in [main, *main.children()]:
        if any(c.laddr.endswith("/in.sock") for c in proc.net_connections("unix")):
            return proc
    raise AssertionError("no gateway process holds in.sock")


def worker_id_of(pid: int) -> str:
    argv = psutil.Process(pid).cmdline()
    return argv[argv.index("--id") + 1]


def assert_serves_on(gw: GatewayProc, pid: int) -> None:
    """A chat request through the OpenAI SDK, answered by the same worker, never restarted."""
    reply = openai_client(gw).chat.completions.create(
        model="chat",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    row = gw.ps()["chat"]
    assert (row["state"], row["pid"], row["restarts"]) == ("ready", pid, 0)
    assert row["error"] is None and row["last_error"] is None
    assert psutil.Process(pid).is_running()
    assert gw.proc.poll() is None


def test_rogue_frames_on_the_gateways_pull_are_dropped(wire_gateway: GatewayProc) -> None:
    gw = wire_gateway
    pid = gw.ps()["chat"]["pid"]
    real = worker_id_of(pid)
    codec = Codec()
    ghost = [
        RequestOutput("ghost-1", "boo"),
        RequestOutput("ghost-2", finish_reason=FinishReason.STOP),
    ]
    truncated_step = codec.encode(StepOutputs(real, 3, ghost))
    garbage = [
        # the real worker's id, carrying garbage: wrong types, a bad enum, cut short, too deep
        pack(["step", real, 3, [["ghost-1", 7]]]),
        pack(["step", real, "three", []]),
        pack(["hb", real, "exploded", 1, 0, 0]),
        truncated_step[: len(truncated_step) // 2],
        b"\x96" + pack("ctlr", real, 3, True) + b"\x81" + pack("a") + DEEP + pack(None),
        # tags of a later protocol, or none at all
        pack(["step2", real, 3, []]),
        pack(["", real]),
        pack({"t": "hello", "worker_id": real}),
    ]
    bad = refused(mangled(golden(FROM_WORKER), seed=24), codec.from_worker.decode) + garbage
    assert refused(garbage, codec.from_worker.decode) == garbage
    forged = [
        # decodable, but from workers nobody spawned: a later protocol's Hello among them
        Hello("rogue-1", PROTOCOL_VERSION + 1, 1, "chat"),
        StepOutputs("rogue-1", 5, ghost),
        Heartbeat("rogue-1", WorkerState.READY, 5, 3, 0),
        WorkerDead("rogue-1", "a rogue says it died"),
        # decodable, in the real worker's name: outputs and replies for nobody, and a second
        # handshake (a wrong version, no capacity) that must not end or change the worker
        StepOutputs(real, 10**6, ghost),
        ControlReply(real, 987_654, True, {"n": 1}),
        Hello(real, PROTOCOL_VERSION + 1, 1, "chat"),
        Ready(real, Capacity(0, 0, 0)),
    ]
    seen = len(gateway_log(gw))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = zmq_socket(context, zmq.PUSH, SNDHWM=0)
    try:
        push.connect(f"ipc://{gw.run_dir}/out.sock")
        for frame in bad:
            push.send(frame)
        push.send_multipart([b"\xc1", b"\x92"])  # parts of one message: each a frame
        for struct in forged:
            push.send(codec.encode(struct))
        push.send(codec.encode(Hello("rogue-last", PROTOCOL_VERSION, 2, "chat")))
        # one socket's frames arrive in order: the last one logged means all were read
        wait_for(
            lambda: "hello from unknown worker 'rogue-last'" in gateway_log(gw),
            timeout=30,
            what="the gateway to read every rogue frame",
        )
    finally:
        push.close()
        context.term()
    text = gateway_log(gw)[seen:]
    assert text.count(UNDECODABLE_FROM_WORKER) == len(bad) + 2, text[-3000:]
    assert "maximum recursion depth" in text  # the deep frame: dropped, not a dead reader
    assert "hello from unknown worker 'rogue-1'" in text
    assert f"protocol {PROTOCOL_VERSION + 1}): ignored" in text
    assert "model chat: Hello from its worker after Ready: ignored" in text
    assert "model chat: Ready from its worker after Ready: ignored" in text
    assert "Traceback" not in text and "protocol version" not in text
    assert_serves_on(gw, pid)
    assert gw.ps()["chat"]["in_flight"] == 0  # the ghost outputs leased nothing


def test_junk_on_the_gateways_router_changes_nothing(wire_gateway: GatewayProc) -> None:
    """The gateway never reads its ROUTER: whatever rogue DEALERs send there, under any
    identity (the real worker's too), neither reaches nor grows it, nor cuts the worker off."""
    gw = wire_gateway
    pid = gw.ps()["chat"]["pid"]
    real = worker_id_of(pid)
    owner = socket_owner(gw)
    rss = owner.memory_info().rss
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rogues = [
        zmq_socket(context, zmq.DEALER, SNDHWM=100),
        zmq_socket(context, zmq.DEALER, SNDHWM=100, IDENTITY=real.encode()),
        zmq_socket(context, zmq.DEALER, SNDHWM=100, IDENTITY=b"rogue"),
    ]
    junk = random.Random(7).randbytes(64 << 10)
    messages = [[junk], [b"\xc1", junk], [b"tiny"]]  # large, multipart, under any limit
    try:
        sent = []
        for rogue, message in zip(rogues, messages, strict=True):
            rogue.connect(f"ipc://{gw.run_dir}/in.sock")
            sent.append(flood(rogue, message, most=3000))
        # while they stay connected, holding all they could queue
        grown = owner.memory_info().rss - rss
        assert grown < 16 << 20, f"{sent} junk messages grew the gateway by {grown >> 20} MiB"
        assert_serves_on(gw, pid)
    finally:
        for rogue in rogues:
            rogue.close()
        context.term()
    assert "Traceback" not in gateway_log(gw)
    assert_serves_on(gw, pid)


# ---- the worker's side --------------------------------------------------------------


class FakeGateway:
    """The test as a worker's gateway: a ROUTER and a PULL bound in a short directory."""

    def __init__(self, root: Path) -> None:
        self.requests, self.outputs = f"ipc://{root}/in.sock", f"ipc://{root}/out.sock"
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.router = zmq_socket(self.context, zmq.ROUTER, ROUTER_MANDATORY=1)
        self.pull = zmq_socket(self.context, zmq.PULL)
        self.router.bind(self.requests)
        self.pull.bind(self.outputs)
        self.codec = Codec()

    def next_frame(self, deadline: float) -> FromWorker | None:
        """The next frame but heartbeats, or None at the deadline."""
        while (left := deadline - time.monotonic()) > 0:
            if self.pull.poll(int(left * 1000) + 1):
                frame = self.codec.from_worker.decode(self.pull.recv())
                if not isinstance(frame, Heartbeat):
                    return frame
        return None

    def send(self, worker_id: str, frame: bytes) -> None:
        self.router.send_multipart([worker_id.encode(), frame])

    def close(self) -> None:
        self.router.close()
        self.pull.close()
        self.context.term()


@pytest.fixture
def wire_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="wire", dir="/tmp"))  # ipc paths: short
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def spawn_worker(root: Path, gateway: FakeGateway, worker_id: str, model: Path) -> Any:
    """`python -m worker` as the gateway spawns it (gateway/workers/processes.py): its own
    session, the BLAS preload of the default server config, output into a log file."""
    config = msgspec.json.encode(ModelConfig(name="chat", source=str(model))).decode()
    server = ServerConfig()
    argv = [sys.executable, "-m", "worker", "--id", worker_id]
    argv += ["--requests", gateway.requests, "--outputs", gateway.outputs, "--model", config]
    with open(root / "worker.log", "wb") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=worker_env(server.blas, server.blas_threads),
            start_new_session=True,
        )


def chat_add(request_id: str) -> Add:
    return Add(
        request_id,
        RequestKind.CHAT,
        CanonicalRequest(messages=[Message("user", "Say something.")]),
        SamplingParams(max_tokens=6, temperature=0.0),
    )


def finish(
    gateway: FakeGateway, worker_id: str, ids: set[str], deadline: float
) -> dict[str, RequestOutput]:
    """Step outputs until each of `ids` has its terminal output (and none of another id)."""
    finished: dict[str, RequestOutput] = {}
    while set(finished) != ids:
        frame = gateway.next_frame(deadline)
        assert isinstance(frame, StepOutputs) and frame.worker_id == worker_id, frame
        for output in frame.outputs:
            assert output.request_id in ids and output.request_id not in finished, output
            if output.finish_reason is not None:
                finished[output.request_id] = output
    return finished


def test_bad_frames_to_a_real_worker_are_dropped(chat_model: Path, wire_root: Path) -> None:
    gateway = FakeGateway(wire_root)
    worker_id = "chat-wire-1"
    proc = spawn_worker(wire_root, gateway, worker_id, chat_model)
    codec = Codec()
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        hello = gateway.next_frame(deadline)
        assert isinstance(hello, Hello), hello
        assert (hello.worker_id, hello.protocol_version, hello.pid) == (
            worker_id,
            PROTOCOL_VERSION,
            proc.pid,
        )
        ready = gateway.next_frame(deadline)
        assert isinstance(ready, Ready) and ready.worker_id == worker_id, ready
        bad = refused(mangled(golden(TO_WORKER), seed=42), codec.to_worker.decode)
        bad += [
            pack(["add2", "r", "chat"]),  # a later protocol's frame
            pack(["shutdown", "now"]),  # a bad enum
            pack(["abort", "r-1"]),  # a string, not a list of ids
            pack(["add", "r-2", "chat", 5, []]),  # a number for a request
            b"\x94" + pack("ctl", 1, "stats") + b"\x81" + pack("a") + DEEP,  # too deep
        ]
        assert len(refused(bad, codec.to_worker.decode)) == len(bad)  # none slipped through
        for frame in bad:
            gateway.send(worker_id, frame)
        gateway.send(worker_id, codec.encode(Abort(["nobody", ""])))  # ids never seen: nothing
        # then requests: one of this protocol, and one as a later gateway may send it (a
        # field appended, which this worker does not know and passes over)
        gateway.send(worker_id, codec.encode(chat_add("wire-1")))
        now = codec.encode(chat_add("wire-2"))
        assert now[0] == 0x97  # an array of seven: the tag and Add's six fields
        gateway.send(worker_id, bytes([0x98]) + now[1:] + pack("a later field"))
        finished = finish(gateway, worker_id, {"wire-1", "wire-2"}, time.monotonic() + 30)
        for output in finished.values():
            assert output.finish_reason is FinishReason.LENGTH and output.error is None
            assert output.usage is not None and output.usage.completion_tokens == 6
        assert proc.poll() is None
        text = (wire_root / "worker.log").read_text(errors="replace")
        assert text.count(UNDECODABLE_FROM_GATEWAY) == len(bad), text[-3000:]
        assert "maximum recursion depth" in text and "Traceback" not in text
        family = psutil.Process(proc.pid).children(recursive=True)
        gateway.send(worker_id, codec.encode(Shutdown()))
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        gateway.close()
    assert not any(p.is_running() for p in family)  # nothing of it left behind
