"""Launching: DeepSpeed hostfile parsing and ``zerospeed launch``, a thin layer over torchrun."""
from zerospeed.launcher.hostfile import parse_hostfile, parse_hostfile_text
from zerospeed.launcher.launch import LaunchPlan, build_torchrun_args, main, parse_args, resolve_plan

__all__ = ["LaunchPlan", "build_torchrun_args", "main", "parse_args", "parse_hostfile", "parse_hostfile_text",
           "resolve_plan"]
