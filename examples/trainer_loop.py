"""A trainer fed by Corral (`corral serve`): take a batch, train, publish the new version, ack it.

.venv/bin/python examples/trainer_loop.py --run RUN_ID --token OPERATOR_TOKEN [--url URL] [--steps N]

(from the repository root after `make install`: the virtualenv's Python is the one with Corral installed)

It outlives the server: while the server is stopping, killed or restarting, each call is asked again
after the delay the server (or the client) gives, and a restarted server hands out the batch it had not
seen acked. While it trains it renews its batch's lease every third of the lease (`ack_timeout_s`, as
the server gives it), so a step longer than the lease is not handed out again meanwhile, and a trainer
killed with SIGKILL holds its batch one lease at most. A Ctrl-C while it trains hands the batch back,
so the next trainer takes it at once.
"""

import argparse
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from app.client import Batch, CorralClient, CorralError, RunEnded, ServerUnavailable

T = TypeVar("T")

parser = argparse.ArgumentParser()
parser.add_argument("--url", default="http://127.0.0.1:8000")
parser.add_argument("--run", required=True)
parser.add_argument("--token", required=True)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--train-s", type=float, default=0.0, help="seconds a step trains (here: waits)")
args = parser.parse_args()


def patiently(call: Callable[[], T]) -> T:
    """`call()`, asked again for as long as the server is unavailable."""
    while True:
        try:
            return call()
        except ServerUnavailable as exc:  # 503 (stopping, the store not keeping up), or no answer at all
            print(f"server unavailable ({exc.detail}); asking again in {exc.retry_after_s:g} s", flush=True)
            time.sleep(exc.retry_after_s)


def next_batch(corral: CorralClient) -> Batch | None:
    """The next batch, or None once the run has ended."""
    try:
        while (batch := patiently(lambda: corral.next_batch(args.run, timeout=30))) is None:
            pass  # nothing trainable yet: ask again
    except RunEnded:
        return None
    return batch


@contextmanager
def leased(corral: CorralClient, batch: Batch) -> Iterator[None]:
    """The block, with `batch`'s lease renewed every third of it in the background: a step longer than the
    lease keeps its batch. The renewals end with the block (before a Ctrl-C hands the batch back)."""
    done = threading.Event()

    def renew() -> None:
        while not done.wait(batch.ack_timeout_s / 3):
            try:
                renewed = corral.renew(args.run, batch)
            except ServerUnavailable:
                continue  # asked again a third of the lease later
            except CorralError as exc:  # the run has ended meanwhile, say
                renewed = {"renewed": False, "detail": exc.detail}
            if not renewed["renewed"]:  # its lease ran out (another trainer may take it): train on
                print(f"batch {batch.index}: lease not renewed: {renewed['detail']}", flush=True)
                return

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        yield
    finally:
        done.set()
        renewer.join()


def train(corral: CorralClient, batch: Batch) -> None:
    """One training step on `batch`; a Ctrl-C before its weights are saved hands the batch back."""
    try:
        with leased(corral, batch):
            # ... one GRPO step on batch.groups; save the weights where the engines can read them ...
            if args.train_s:
                print(f"batch {batch.index}: training for {args.train_s:g} s", flush=True)
                time.sleep(args.train_s)
    except KeyboardInterrupt:
        try:
            patiently(lambda: corral.release(args.run, batch))
            print(f"batch {batch.index}: handed back untrained", flush=True)
        except CorralError as exc:  # the run has ended meanwhile, say; its lease ends it all the same
            print(f"batch {batch.index}: not handed back: {exc.detail}", flush=True)
        raise


def main(corral: CorralClient) -> None:
    steps = 0
    while steps < args.steps and (batch := next_batch(corral)) is not None:
        rewards = batch.rewards  # each group's trajectories: turns, reward, advantage, policy versions
        train(corral, batch)
        published = f"published v{batch.publish_version}"
        try:  # asked again, the same version is answered as published, never published twice
            patiently(lambda: corral.publish(args.run, batch.publish_version, sentinel=True))  # or path=
        except RunEnded:  # the run ended (or is stopping) after it offered this batch: no engine loads it
            published = f"v{batch.publish_version} not published: the run has ended"
        except CorralError as exc:
            # A newer version was published meanwhile (by an operator): the engines have it or will; the
            # step still ends with the ack.
            if exc.status != 422 or "is not newer than" not in exc.detail:
                raise
            published = f"v{batch.publish_version} not published: a newer version was"
        patiently(lambda: corral.ack(args.run, batch.batch_id))  # an ended run's batch is acked too
        steps += 1
        print(
            f"batch {batch.index}: {len(batch.groups)} groups, mean reward "
            f"{sum(rewards) / len(rewards):.3f}, {published}",
            flush=True,
        )


with CorralClient(args.url, token=args.token, actor="example-trainer") as client:
    try:
        main(client)
    except KeyboardInterrupt:  # Ctrl-C: a batch being trained on was handed back (`train`)
        sys.exit(130)
