"""Storage: the shared read-only base image, the tools layer and per-sandbox writable layers."""

from agentenv.storage.images import ImageBuildError, ImageStore, ProgressFn
from agentenv.storage.rootfs import RootfsManager

__all__ = ["ImageBuildError", "ImageStore", "ProgressFn", "RootfsManager"]
