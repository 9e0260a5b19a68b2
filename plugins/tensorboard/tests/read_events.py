"""Reads a run directory written by accel's TensorBoard tracker with
TensorBoard's own readers and prints what they see as JSON.

Usage: python read_events.py RUN_DIR

Output keys:
  files     the event files in RUN_DIR
  records   per file: the records TensorBoard's TFRecord reader accepts
            (every CRC checked), each as {step, wall_time, file_version, tags},
            and `stop`: why reading stopped ("eof", or the reader's error)
  scalars   {tag: [[step, value], ...]} from EventAccumulator (scalars plugin)
  text      {tag: [[step, text], ...]} from EventAccumulator (text plugin)
  images    {tag: [{step, width, height, mode, pixels}, ...]} from
            EventAccumulator.Images, the PNG decoded by PIL (pixels: every
            channel of every pixel, row by row)
  histograms {tag: [{step, min, max, num, sum, sum_squares, bucket_limit,
            bucket}, ...]} from EventAccumulator.Histograms
  provider  {tag: [[step, value], ...]} from the data provider the TensorBoard
            server uses (MultiplexerDataProvider.read_scalars)
  hparams   experiment / session_start / session_end, parsed by the hparams
            plugin's own metadata module (null when absent)
"""

import io
import json
import os
import sys

from PIL import Image

from tensorboard import context
from tensorboard.backend.event_processing import data_provider
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
from tensorboard.plugins.hparams import api_pb2, metadata
from tensorboard.util import tensor_util


def raw_records(path):
    reader = PyRecordReader_New(path)
    out = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return out, "eof"
        except errors.DataLossError as e:
            return out, "data loss: " + str(e.message if hasattr(e, "message") else e)
        event = event_pb2.Event.FromString(reader.record())
        out.append(
            {
                "step": event.step,
                "wall_time": event.wall_time,
                "file_version": event.file_version or None,
                "tags": [v.tag for v in event.summary.value],
            }
        )


def value_of(v):
    kind = v.WhichOneof("kind")
    return None if kind is None else getattr(v, kind)


def main():
    run_dir = sys.argv[1]
    files = sorted(f for f in os.listdir(run_dir) if "tfevents" in f)
    records = {}
    for f in files:
        recs, stop = raw_records(os.path.join(run_dir, f))
        records[f] = {"records": recs, "stop": stop}

    acc = ea.EventAccumulator(
        run_dir, size_guidance={ea.TENSORS: 0, ea.IMAGES: 0, ea.HISTOGRAMS: 0}
    )
    acc.Reload()
    scalars = {}
    text = {}
    for tag in acc.Tags()[ea.TENSORS]:
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
        events = acc.Tensors(tag)
        if plugin == "scalars":
            scalars[tag] = [[e.step, float(tensor_util.make_ndarray(e.tensor_proto))] for e in events]
        elif plugin == "text":
            text[tag] = [
                [e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode("utf-8")]
                for e in events
            ]

    images = {}
    for tag in acc.Tags()[ea.IMAGES]:
        images[tag] = []
        for e in acc.Images(tag):
            img = Image.open(io.BytesIO(e.encoded_image_string))
            images[tag].append(
                {
                    "step": e.step,
                    "width": e.width,
                    "height": e.height,
                    "mode": img.mode,
                    "size": list(img.size),
                    "pixels": [c for p in img.getdata() for c in (p if isinstance(p, tuple) else (p,))],
                }
            )
    histograms = {}
    for tag in acc.Tags()[ea.HISTOGRAMS]:
        histograms[tag] = [
            {
                "step": e.step,
                "min": e.histogram_value.min,
                "max": e.histogram_value.max,
                "num": e.histogram_value.num,
                "sum": e.histogram_value.sum,
                "sum_squares": e.histogram_value.sum_squares,
                "bucket_limit": list(e.histogram_value.bucket_limit),
                "bucket": list(e.histogram_value.bucket),
            }
            for e in acc.Histograms(tag)
        ]

    hparams = {"experiment": None, "session_start": None, "session_end": None}
    try:
        contents = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    except KeyError:
        contents = {}
    if metadata.EXPERIMENT_TAG in contents:
        exp = metadata.parse_experiment_plugin_data(contents[metadata.EXPERIMENT_TAG])
        hparams["experiment"] = {
            "hparam_infos": [
                {"name": h.name, "type": api_pb2.DataType.Name(h.type)} for h in exp.hparam_infos
            ],
            "time_created_secs": exp.time_created_secs,
        }
    if metadata.SESSION_START_INFO_TAG in contents:
        ssi = metadata.parse_session_start_info_plugin_data(
            contents[metadata.SESSION_START_INFO_TAG]
        )
        hparams["session_start"] = {
            "hparams": {k: value_of(v) for k, v in ssi.hparams.items()},
            "start_time_secs": ssi.start_time_secs,
        }
    if metadata.SESSION_END_INFO_TAG in contents:
        sei = metadata.parse_session_end_info_plugin_data(contents[metadata.SESSION_END_INFO_TAG])
        hparams["session_end"] = {
            "status": api_pb2.Status.Name(sei.status),
            "end_time_secs": sei.end_time_secs,
        }

    # What the TensorBoard server's scalar dashboard gets.
    logdir = os.path.dirname(os.path.abspath(run_dir))
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, logdir)
    run = os.path.basename(os.path.abspath(run_dir))
    read = provider.read_scalars(
        context.RequestContext(), experiment_id="", plugin_name="scalars", downsample=10000
    )
    provider_scalars = {
        tag: [[d.step, d.value] for d in data] for tag, data in read.get(run, {}).items()
    }

    json.dump(
        {
            "files": files,
            "records": records,
            "scalars": scalars,
            "text": text,
            "images": images,
            "histograms": histograms,
            "provider": provider_scalars,
            "hparams": hparams,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
