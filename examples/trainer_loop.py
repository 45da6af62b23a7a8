"""A trainer fed by Corral (`corral serve`): take a batch, train, publish the new version, ack it.

python examples/trainer_loop.py --run RUN_ID --token OPERATOR_TOKEN [--url URL] [--steps N]
"""

import argparse
import time

from app.client import CorralClient, RunEnded, ServerUnavailable

parser = argparse.ArgumentParser()
parser.add_argument("--url", default="http://127.0.0.1:8000")
parser.add_argument("--run", required=True)
parser.add_argument("--token", required=True)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

with CorralClient(args.url, token=args.token, actor="example-trainer") as corral:
    steps = 0
    while steps < args.steps:
        try:
            while (batch := corral.next_batch(args.run, timeout=30)) is None:
                pass  # nothing trainable yet: ask again
        except RunEnded:
            break
        except ServerUnavailable as exc:  # stopping, or its database away: a restarted server goes on
            print(f"server unavailable ({exc.detail}); asking again in {exc.retry_after_s:g} s")
            time.sleep(exc.retry_after_s)
            continue
        rewards = batch.rewards  # each group's trajectories: turns, reward, advantage, policy versions
        # ... one GRPO step on batch.groups; save the weights where the engines can read them ...
        corral.publish(args.run, batch.publish_version, sentinel=True)  # or path="/weights/v7"
        corral.ack(args.run, batch.batch_id)
        steps += 1
        print(
            f"batch {batch.index}: {len(batch.groups)} groups, mean reward "
            f"{sum(rewards) / len(rewards):.3f}, published v{batch.publish_version}"
        )
