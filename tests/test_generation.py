"""The process-wide generation: caches drop what they held under another environment."""

from farm.core.generation import GenerationCache, bump_generation, generation


def test_generation_reset_drops_cache_entries() -> None:
    cache: GenerationCache[str, int] = GenerationCache()
    cache.put("a", 1)
    assert cache.get("a") == 1
    before = generation()
    assert bump_generation() > before
    assert cache.get("a") is None
    assert len(cache) == 0
    cache.put("a", 2)
    assert cache.get_or_create("a", lambda: 3) == 2
