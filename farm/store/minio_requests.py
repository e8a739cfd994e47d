"""The requests a MinIO store's parts are written against: one declaration, shared by
the mixins that make :class:`~farm.store.minio.MinioStore` (:mod:`farm.store.
minio_blobs`, :mod:`farm.store.minio_index`, :mod:`farm.store.minio_removal`), which
each use some of them and implement none but their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Fetched(Protocol):
    """An object as read (``farm.store.minio._Object``)."""

    @property
    def data(self) -> bytes: ...

    @property
    def etag(self) -> str: ...


class BucketRequests(ABC):
    """One bucket's requests, as :class:`~farm.store.minio.MinioStore` makes them."""

    @property
    @abstractmethod
    def location(self) -> str: ...

    @abstractmethod
    def _fetch(self, name: str) -> Fetched | None: ...

    @abstractmethod
    def _write_if(self, name: str, body: bytes, headers: dict[str, str],
                  condition: dict[str, str]) -> bool: ...

    @abstractmethod
    def _call(self, what: str, fn: Callable[[], T]) -> T: ...

    @abstractmethod
    def _list(self, prefix: str, *, recursive: bool) -> list[str]: ...

    @abstractmethod
    def _remove(self, name: str) -> None: ...
