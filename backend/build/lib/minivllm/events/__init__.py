"""The event stream: wire types (types.py), the bus that stamps and fans them out (bus.py), the
fold that replays them onto a snapshot (fold.py), and JSONL recordings of them (recording.py)."""
