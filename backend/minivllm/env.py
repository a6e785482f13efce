"""On/off switches from the environment: one spelling of yes and no for every MINIVLLM_* flag."""

from __future__ import annotations

import os

YES = ("1", "true", "yes", "on")
NO = ("0", "false", "no", "off")


def says_yes(value: str) -> bool:
    return value.lower() in YES


def env_flag(name: str, default: bool = False) -> bool:
    """$name as a switch: yes (1/true/yes/on), no (0/false/no/off), else (unset or anything else) `default`."""
    value = os.environ.get(name, "").lower()
    return True if value in YES else False if value in NO else default
