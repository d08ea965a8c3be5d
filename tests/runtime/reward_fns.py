"""Reward functions that misbehave, importable by spawned reward workers."""

import time


def ok(text, example):
  return float(text == example["answer"])


def crash(text, example):
  raise ValueError("boom")


def hang(text, example):
  time.sleep(60)
  return 1.0
