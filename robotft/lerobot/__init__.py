"""Everything that talks to LeRobot, in one place: datasets in and out (`dataset.py`: `robotft data import
--from-lerobot`, `robotft data export --to-lerobot`) and LeRobot policies behind robotft's Policy contract
(`policy.py`: `robotft policy import --from-lerobot`). lerobot itself is imported only when used (the `lerobot`
extra)."""
