"""The LeRobot tests' fixtures: the toy nav2d BC and fine-tuning runners shared with tests/rl
(tests/toy_fixtures.py). The LeRobot checkpoints themselves come from lerobot_fixtures.py, which each test module
imports (it skips the module when lerobot is not installed)."""

import toy_fixtures

toy_demos = toy_fixtures.toy_demos
toy_pretrain = toy_fixtures.toy_pretrain
toy_finetune = toy_fixtures.toy_finetune
