package main

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// drawChart draws one panel per operation: GB/s against bytes per
// operation, a solid line per backend (one descriptor, the first depth)
// and dashed lines for the baselines and ucx_perftest, on the same axes.
func drawChart(name string, rs []Result, ri runInfo) error {
	var ops []string
	for _, r := range rs {
		if _, err := parseDirection(r.Op); err == nil && !slices.Contains(ops, r.Op) {
			ops = append(ops, r.Op)
		}
	}
	if len(ops) == 0 {
		return fmt.Errorf("nothing to draw")
	}
	depth := 0
	for _, r := range rs {
		if r.Kind == "goxfer" {
			depth = r.Inflight
			break
		}
	}
	plots := make([]*plot.Plot, len(ops))
	for i, op := range ops {
		p := plot.New()
		p.Title.Text = fmt.Sprintf("%s, one descriptor per operation", op)
		if depth > 1 {
			p.Title.Text += fmt.Sprintf(", %d in flight", depth)
		}
		p.X.Label.Text = "bytes per operation"
		p.Y.Label.Text = "GB/s"
		p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
		p.X.Tick.Marker = sizeTicks{}
		p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
		p.Legend.Top, p.Legend.Left = true, true
		p.Legend.TextStyle.Font.Size = vg.Points(8)
		p.Add(plotter.NewGrid())
		series := map[string]plotter.XYs{}
		var order []string
		for _, r := range rs {
			if r.Op != op || r.GBps <= 0 || r.Descs != 1 || (r.Kind == "goxfer" && r.Inflight != depth) || r.Kind == "control" {
				continue
			}
			key := r.Kind + "|" + r.Name
			if r.InitiatorMem != "" && (r.InitiatorMem != memDRAM.String() || r.TargetMem != memDRAM.String()) {
				key += " " + r.InitiatorMem + "/" + r.TargetMem
			}
			if r.Device == "sim" {
				key += " [sim]"
			}
			if _, ok := series[key]; !ok {
				order = append(order, key)
			}
			series[key] = append(series[key], plotter.XY{X: float64(r.Bytes), Y: r.GBps})
		}
		for k, key := range order {
			xys := series[key]
			slices.SortFunc(xys, func(a, b plotter.XY) int { return int(math.Copysign(1, a.X-b.X)) })
			l, pts, err := plotter.NewLinePoints(xys)
			if err != nil {
				return err
			}
			kind, label, _ := strings.Cut(key, "|")
			c := palette[k%len(palette)]
			l.Color, pts.Color = c, c
			l.Width = vg.Points(1.5)
			pts.Shape = shapes[k%len(shapes)]
			if kind != "goxfer" {
				l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
				l.Width = vg.Points(1)
			} else {
				label = "goxfer " + label
			}
			p.Add(l, pts)
			p.Legend.Add(label, l, pts)
		}
		// Room above the curves for the legend (log scale: 1.5 decades).
		p.Y.Max *= 30
		plots[i] = p
	}
	w, h := vg.Points(480*float64(len(plots))), vg.Points(400)
	var c draw.Canvas
	var save func(*os.File) error
	switch strings.ToLower(fileExt(name)) {
	case ".svg":
		sc := vgsvg.New(w, h)
		c = draw.New(sc)
		save = func(f *os.File) error { _, err := sc.WriteTo(f); return err }
	default:
		ic := vgimg.New(w, h)
		c = draw.New(ic)
		save = func(f *os.File) error { _, err := vgimg.PngCanvas{Canvas: ic}.WriteTo(f); return err }
	}
	tiles := draw.Tiles{Rows: 1, Cols: len(plots), PadX: vg.Points(12), PadY: vg.Points(12), PadTop: vg.Points(6), PadBottom: vg.Points(6), PadLeft: vg.Points(6), PadRight: vg.Points(6)}
	canvases := plot.Align([][]*plot.Plot{plots}, tiles, c)
	for i, p := range plots {
		p.Draw(canvases[0][i])
	}
	f, err := os.Create(name)
	if err != nil {
		return err
	}
	if err := save(f); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

var palette = []color.Color{
	color.RGBA{0x1f, 0x77, 0xb4, 0xff}, color.RGBA{0xd6, 0x27, 0x28, 0xff}, color.RGBA{0x2c, 0xa0, 0x2c, 0xff},
	color.RGBA{0xff, 0x7f, 0x0e, 0xff}, color.RGBA{0x94, 0x67, 0xbd, 0xff}, color.RGBA{0x8c, 0x56, 0x4b, 0xff},
	color.RGBA{0xe3, 0x77, 0xc2, 0xff}, color.RGBA{0x7f, 0x7f, 0x7f, 0xff}, color.RGBA{0xbc, 0xbd, 0x22, 0xff},
	color.RGBA{0x17, 0xbe, 0xcf, 0xff},
}

var shapes = []draw.GlyphDrawer{draw.CircleGlyph{}, draw.SquareGlyph{}, draw.TriangleGlyph{}, draw.CrossGlyph{}, draw.PlusGlyph{}, draw.RingGlyph{}, draw.BoxGlyph{}, draw.PyramidGlyph{}}

// sizeTicks labels powers of two in binary units.
type sizeTicks struct{}

func (sizeTicks) Ticks(lo, hi float64) []plot.Tick {
	var ts []plot.Tick
	for e := math.Floor(math.Log2(lo)); math.Pow(2, e) <= hi*1.0001; e++ {
		v := math.Pow(2, e)
		if v < lo*0.9999 {
			continue
		}
		t := plot.Tick{Value: v}
		if int(e)%2 == 0 {
			t.Label = strings.ReplaceAll(fmtSize(v), " ", "")
		}
		ts = append(ts, t)
	}
	return ts
}
