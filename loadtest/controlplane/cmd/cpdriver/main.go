// Command cpdriver is a small client-go driver for Bulwark's Rust tests. It
// talks to a kube-apiserver (directly, or through Bulwark) with the real
// client-go machinery, so the tests see exactly what kubelet, kube-proxy and
// controllers would see.
//
// Subcommands (each prints one JSON document on stdout; on error it prints
// the error on stderr and exits 1):
//
//	cpdriver informer-compare --via KUBECONFIG_A --direct KUBECONFIG_B \
//	    --resource secrets|endpointslices [--namespace NS] [--accept STRING] \
//	    [--content-type STRING] [--watchlist] [--churn N] [--timeout 60s]
//	cpdriver list-pages --kubeconfig K --resource secrets|endpointslices \
//	    --limit N [--namespace NS] [--continue-via K2] [--accept STRING]
//	cpdriver object-compare --via KUBECONFIG_A --direct KUBECONFIG_B \
//	    --resource secrets|endpointslices [--namespace NS] [--accept STRING]
//	cpdriver informer-resume --via KUBECONFIG_A --direct KUBECONFIG_B \
//	    --resource secrets|endpointslices --ready-file F --done-file F \
//	    [--accept STRING] [--interval 100ms] [--after N] [--timeout 120s]
//
// See informer.go, pages.go, objects.go and resume.go.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/transport"
)

func main() {
	if len(os.Args) < 2 {
		usage(os.Stderr)
		os.Exit(1)
	}
	var out any
	var err error
	switch os.Args[1] {
	case "informer-compare":
		out, err = informerCompare(os.Args[2:])
	case "list-pages":
		out, err = listPages(os.Args[2:])
	case "object-compare":
		out, err = objectCompare(os.Args[2:])
	case "informer-resume":
		out, err = informerResume(os.Args[2:])
	case "-h", "-help", "--help", "help":
		usage(os.Stdout)
		return
	default:
		err = fmt.Errorf("unknown subcommand %q", os.Args[1])
	}
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "cpdriver %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(out); err != nil {
		fmt.Fprintf(os.Stderr, "cpdriver: writing JSON: %v\n", err)
		os.Exit(1)
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: cpdriver informer-compare|list-pages|object-compare|informer-resume [flags] (cpdriver SUBCOMMAND -h for flags)")
}

// newFlagSet returns a flag set that reports errors instead of exiting, so
// main prints them the same way as every other error.
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(os.Stderr)
	return fs
}

// clientFor builds a typed clientset from a kubeconfig file. A non-empty
// accept sets rest.Config.AcceptContentTypes, and contentType (derived from
// accept when empty) sets rest.Config.ContentType, the way kubelet and
// kube-proxy configure their clients.
func clientFor(kubeconfig, accept, contentType string) (kubernetes.Interface, error) {
	cfg, err := configFor(kubeconfig, accept, contentType)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}

// clientWrapped is clientFor (the content type derived from accept) with its
// transport wrapped by wrap, to see the requests it sends.
func clientWrapped(kubeconfig, accept string, wrap transport.WrapperFunc) (kubernetes.Interface, error) {
	cfg, err := configFor(kubeconfig, accept, "")
	if err != nil {
		return nil, err
	}
	cfg.WrapTransport = wrap
	return kubernetes.NewForConfig(cfg)
}

// configFor is the rest.Config of clientFor.
func configFor(kubeconfig, accept, contentType string) (*rest.Config, error) {
	if kubeconfig == "" {
		return nil, errors.New("a kubeconfig path is required")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", kubeconfig, err)
	}
	if accept != "" {
		cfg.AcceptContentTypes = accept
		if contentType == "" {
			contentType = contentTypeFromAccept(accept)
		}
	}
	if contentType != "" {
		cfg.ContentType = contentType
	}
	// The default 5 QPS would make churn and paging slow; the tests bound
	// their own load.
	cfg.QPS = 200
	cfg.Burst = 400
	cfg.UserAgent = "bulwark-cpdriver"
	return cfg, nil
}

// contentTypeFromAccept picks the request content type that matches an
// Accept list: its first media type, or JSON when that is a wildcard.
func contentTypeFromAccept(accept string) string {
	first := strings.TrimSpace(strings.Split(accept, ",")[0])
	first = strings.TrimSpace(strings.Split(first, ";")[0])
	if first == "" || strings.Contains(first, "*") {
		return "application/json"
	}
	return first
}
