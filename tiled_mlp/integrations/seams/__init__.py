"""One small module per dependency whose internals the stack calls (not its public, documented API).

Each seam holds every such call into its library, the range of releases the calls were checked on
(``CHECKED``), and the adaptations between those releases, decided once at apply time by inspecting
what the library is (a signature, whether a name exists), never per call. A release outside the range is
refused when the piece that needs it is applied, naming both versions (``checked_versions.require``),
instead of failing with a TypeError inside a forward.
"""
