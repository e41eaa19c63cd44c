"""`tldp weight-mask`."""

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from tldp_cli.cli.options import InputFormatOption, Quiet, Debug, data_path, file_path, output_path
from tldp_cli.cli.app import app, debugging, run


class MaskMethod(str, Enum):
    intensity = "intensity"
    box = "box"
    image = "image"
    constant = "constant"
    faces = "faces"


@app.command("weight-mask", no_args_is_help=True)
def weight_mask_command(
    input: Annotated[Path, typer.Argument(parser=data_path,
        metavar="INPUT",
        help="The data the mask is for, any input perturb reads: a .npy file, an HDF5 file, a "
             "Zarr store, a table (.parquet, .arrow, a dataset folder), WebDataset shards or a "
             "folder of images (detected).", show_default=False)],
    method: Annotated[MaskMethod, typer.Option(
        help="constant: one weight everywhere (--weight). box: rectangles from a JSON or CSV "
             "file (--boxes). image: a grayscale picture of the weights (--mask-image). "
             "intensity: the paper's MNIST rule, w = ((x - lo) / (hi - lo)) ** gamma, one mask "
             "per record, computed from the private values (so it depends on the data). "
             "faces: face regions found by OpenCV's bundled Haar cascade (pip install "
             "'tldp-tensors[faces]'), also data-derived.",
        show_default=False)],
    out: Annotated[Path, typer.Option(parser=output_path, metavar="PATH",
        help="The mask: a .npy file, or for a folder of images a folder of mask PNGs (8-bit "
             "grayscale, 0..255 = weight 0..1) named like the images. A sidecar OUT.json "
             "records the method.", show_default=False)],
    weight: Annotated[Optional[float], typer.Option(
        help="constant: the weight, in [0, 1]. box: the weight of boxes that give none; "
             "faces: the weight of faces (default 1).", show_default=False)] = None,
    boxes: Annotated[Optional[Path], typer.Option(parser=file_path, metavar="PATH",
        help="box: JSON list of {x0, y0, x1, y1, weight?, file?} or CSV x0,y0,x1,y1,weight "
             "(a header may name the columns, with an optional file column). Pixels, x the "
             "column, y the row, x1 and y1 exclusive. A box with a file applies to that image "
             "only; overlapping boxes take the larger weight.", show_default=False)] = None,
    mask_image: Annotated[Optional[Path], typer.Option(parser=data_path, metavar="PATH",
        help="image: a grayscale image, black = weight 0, white = weight 1.",
        show_default=False)] = None,
    resize: Annotated[bool, typer.Option(
        help="image: resize the mask image to the records' size (bilinear) instead of "
             "refusing a different size.")] = False,
    value_range: Annotated[Optional[str], typer.Option(
        "--range", metavar="LO:HI",
        help="intensity, faces: the declared value range (as for perturb; 8- and 16-bit "
             "integer data defaults to its dtype's range). Also scales the preview.")] = None,
    gamma: Annotated[Optional[float], typer.Option(
        help="intensity: exponent of the rule (default 1).", show_default=False)] = None,
    margin: Annotated[Optional[float], typer.Option(
        help="faces: grow each face box by this fraction of its size on every side "
             "(default 0.2).", show_default=False)] = None,
    feather: Annotated[int, typer.Option(
        metavar="PIXELS", help="Soften the mask's edges: weights ramp down to 0 over PIXELS "
                               "pixels outward (never lowered inside).")] = 0,
    preview: Annotated[Optional[Path], typer.Option(parser=output_path, metavar="PATH",
        help="Write a PNG of the first record or image with the mask tinted red, to check by "
             "eye. It shows the private data: keep it private.", show_default=False)] = None,
    dataset: Annotated[Optional[str], typer.Option(
        metavar="PATH", help="HDF5/Zarr: the array the mask is for.", show_default=False)] = None,
    input_format: InputFormatOption = None,
    skip_bad: Annotated[bool, typer.Option(
        help="Image folders: skip unreadable images (named in a message; no mask is made for "
             "them, as perturb --skip-bad perturbs none) instead of stopping; every image is then "
             "decoded up front to find them.")] = False,
    data_derived: Annotated[bool, typer.Option(
        help="box/image: record that the regions were found in the private data themselves "
             "(e.g. by a detector run on each image).")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing mask, sidecar or preview.")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the sidecar (how the mask was made) and the files written as JSON "
                       "to stdout.")] = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Make a weight mask for weighted TLDP (perturb --weights).

    A weight w in [0, 1] per position lowers the chance that the raw value is
    kept from p to (1 - w) p. A mask of the records' spatial shape covers every
    channel.

    \b
    Examples:
      tldp weight-mask photos/ --method box --boxes faces.csv --out masks --preview check.png
      tldp perturb photos/ --eps 1 --weights masks
      tldp weight-mask sample_data/digits.npy --method intensity --out digits.mask.npy
      tldp weight-mask data.npy --method constant --weight 0.5 --out half.npy
      tldp weight-mask photos/ --method image --mask-image region.png --resize --out masks
      tldp weight-mask photos/ --method faces --margin 0.3 --feather 8 --out masks --preview check.png
    """
    from tldp_cli.run.options import parse_range
    from tldp_cli.weight_mask import MaskOptions, make_mask

    debug = debugging(debug)

    def action():
        return make_mask(MaskOptions(
            input=input, method=method.value, out=out, weight=weight, boxes=boxes,
            mask_image=mask_image, resize=resize,
            value_range=parse_range(value_range) if value_range else None, gamma=gamma,
            margin=margin, feather=feather, preview=preview, dataset=dataset, data_derived=data_derived,
            overwrite=overwrite, input_format=input_format and input_format.value, skip_bad=skip_bad))

    result = run(debug, action)
    if not quiet:
        for message in result.messages:
            typer.echo(f"tldp: {message}", err=True)
        also = f"; preview {result.preview}" if result.preview else ""
        typer.echo(f"tldp: wrote {result.output} ({result.description}, method {method.value}) "
                   f"and {result.sidecar}{also}", err=True)
    if json_out:
        sidecar = json.loads(Path(result.sidecar).read_text())
        typer.echo(json.dumps({"mask": str(result.output), "sidecar": str(result.sidecar),
                               "preview": str(result.preview) if result.preview else None,
                               **sidecar}, indent=2))


