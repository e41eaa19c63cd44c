"""The names of a Zarr store's metadata files (formats/zarr_store.py), which make a folder a
store: detection checks them without importing zarr-python (docs/performance.md), and
zarr_tree.py tells the store's metadata from its other files by them."""

METADATA_FILES = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")
