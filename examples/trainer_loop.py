"""A trainer fed by Corral (`corral serve`): take a batch, train, publish the new version, ack it.

python examples/trainer_loop.py --run RUN_ID --token OPERATOR_TOKEN [--url URL] [--steps N]
"""

import argparse

from app.client import CorralClient, RunEnded

parser = argparse.ArgumentParser()
parser.add_argument("--url", default="http://127.0.0.1:8000")
parser.add_argument("--run", required=True)
parser.add_argument("--token", required=True)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

with CorralClient(args.url, token=args.token, actor="example-trainer") as corral:
    for _ in range(args.steps):
        try:
            while (batch := corral.next_batch(args.run, timeout=30)) is None:
                pass  # nothing trainable yet: ask again
        except RunEnded:
            break
        rewards = batch.rewards  # each group's trajectories: turns, reward, advantage, policy versions
        # ... one GRPO step on batch.groups; save the weights where the engines can read them ...
        corral.publish(args.run, batch.publish_version, sentinel=True)  # or path="/weights/v7"
        corral.ack(args.run, batch.batch_id)
        print(
            f"batch {batch.index}: {len(batch.groups)} groups, mean reward "
            f"{sum(rewards) / len(rewards):.3f}, published v{batch.publish_version}"
        )
