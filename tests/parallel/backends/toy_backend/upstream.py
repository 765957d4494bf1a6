"""Stands in for an upstream library function that the toy backend patches during a run."""


def describe() -> str:
    return "upstream"
