"""Environments: where an episode's harness runs (`environment:` in a config): on this machine,
in bubblewrap, or in a fresh container per episode (the container's only way out is its
gateway to the proxy's model routes). An environment knows the task it runs, never the
harness, the rewards or the engine: it imports tasks alone of harness_adapters's rooms.
"""

from typing import Annotated

from pydantic import Field

from harness_adapters.environments.box import Box, BuildError, ContainerError, TestsError
from harness_adapters.environments.containers import BASE_IMAGE, ContainerEnvironment, base_image
from harness_adapters.environments.host import BubblewrapEnvironment, HostEnvironment

# The kinds a config's `environment:` may name, told apart by `type`.
Environment = Annotated[HostEnvironment | BubblewrapEnvironment | ContainerEnvironment, Field(discriminator="type")]

__all__ = [
    "BASE_IMAGE",
    "Box",
    "BubblewrapEnvironment",
    "BuildError",
    "ContainerEnvironment",
    "ContainerError",
    "Environment",
    "HostEnvironment",
    "TestsError",
    "base_image",
]
